"""``diffpipe bench``: training throughput, memory and MFU over a grid of settings, on this machine.

Each point of the grid trains real steps of the configured model in its own
process (``diffpipe.bench.point``, through the same ``train`` as ``diffpipe
train``), so an out-of-memory point is recorded and the sweep goes on.
"""

from diffpipe.bench.convergence import run_convergence
from diffpipe.bench.grid import parse_grid_args
from diffpipe.bench.sweep import BenchResult, run_bench

__all__ = ["BenchResult", "parse_grid_args", "run_bench", "run_convergence"]
