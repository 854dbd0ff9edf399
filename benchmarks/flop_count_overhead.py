"""FLOP counting's cost on training speed: ``diffpipe train`` with ``train.count_flops`` on and off.

Usage (figure in docs/benchmarks.md, "FLOP counting overhead"):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/flop_count_overhead.py [--steps 40] [--rounds 3] [--dir /tmp/tb]

The run of ``benchmarks/train_step_bench.py`` (tiny SD UNet, LoRA rank 8,
batch 4 of 32x32 latents, one bucket shape, in process), trained with FLOP
counting on and off, alternating for ``--rounds`` rounds in one process.
Reported, the median and the minimum over rounds (on a shared machine the
minimum is the least disturbed): the first step (where the counter runs: the
one step of this shape that is counted) and the steady state (wall time
between step ``--warmup`` and the last step but one, per step, where the
count is reused). Target: steady-state ratio on/off within noise (<= 1.02).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from train_step_bench import base_config, prepare_run  # noqa: E402  (the same cached run)

from diffpipe.paths import RunPaths  # noqa: E402
from diffpipe.training.metrics import read_metrics  # noqa: E402


def one_run(root: Path, steps: int, warmup: int, count: bool) -> tuple[float, float, float | None]:
    """(first step s, steady-state s/step, logged TFLOPS per device) of one in-process run."""
    from diffpipe.training.loop import train

    cfg = base_config(root, steps)
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"count_flops": count})})
    paths = RunPaths(cfg.output_dir)
    shutil.rmtree(paths.train_dir, ignore_errors=True)
    train(cfg, paths, log=lambda *a: None)
    rows = read_metrics(paths.metrics)
    steady = (rows[-2]["elapsed_s"] - rows[warmup - 1]["elapsed_s"]) / (len(rows) - 1 - warmup)
    tflops = statistics.median(r["tflops_per_device"] for r in rows[warmup:-1]) if count else None
    return rows[0]["step_time"], steady, tflops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/diffpipe-train-bench"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = prepare_run(args.dir)
    runs: dict[str, list[tuple[float, float, float | None]]] = {"on": [], "off": []}
    for _ in range(args.rounds):
        for name in ("off", "on"):
            runs[name].append(one_run(root, args.steps, args.warmup, name == "on"))

    def med(name: str, i: int) -> float:
        return statistics.median(r[i] for r in runs[name])

    def low(name: str, i: int) -> float:
        return min(r[i] for r in runs[name])

    result = {
        "first_step_s": {"off": med("off", 0), "on": med("on", 0), "min_off": low("off", 0), "min_on": low("on", 0)},
        "first_step_ratio": {"median": med("on", 0) / med("off", 0), "min": low("on", 0) / low("off", 0)},
        "steady_step_s": {"off": med("off", 1), "on": med("on", 1), "min_off": low("off", 1), "min_on": low("on", 1)},
        "steady_ratio": {"median": med("on", 1) / med("off", 1), "min": low("on", 1) / low("off", 1)},
        "tflops_per_device": med("on", 2),
        "flops_per_step": read_metrics(RunPaths(base_config(root, 1).output_dir).metrics)[0].get("flops_per_step"),
        "rounds": runs,
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
