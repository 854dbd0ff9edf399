"""``diffpipe bench`` sweeps: the grid's summary, plot and out-of-memory points.

Through the CLI on the tiny SD model, few steps: every bench point is a process of its own. The
convergence run is in test_bench_convergence.py: a file of its own, so that the two multi-process
runs go to two pytest-xdist workers (each file stays on one).
"""

from __future__ import annotations

import csv

from PIL import Image
from stage_cli import starter_in_process
from tiny_runs import bench_config

from diffpipe.bench.grid import parse_grid_args, points
from diffpipe.bench.sweep import MEASURES
from diffpipe.paths import RunPaths
from diffpipe.training.metrics import read_metrics

COLUMNS = ["point", "batch_size", "precision", "base_weights", "activation_checkpointing", "compile",
           "attention_backend", "zero_stage", "resolution", "frames", *MEASURES]


def test_grid_points_are_the_product_of_the_axes_the_first_varying_slowest():
    grid = parse_grid_args(["batch_size=1,512", "precision=fp32,bf16", "train.seed=7"])
    assert grid == {"batch_size": [1, 512], "precision": ["fp32", "bf16"], "train.seed": [7]}
    assert [tuple(p.values()) for p in points(grid)] == [
        (1, "fp32", 7), (1, "bf16", 7), (512, "fp32", 7), (512, "bf16", 7)]
    assert points({}) == [{}]


def test_grid_writes_every_column_and_a_plot_and_records_out_of_memory(tiny_run, tmp_path):
    # Under a 3000 MiB address-space cap the tiny model trains at micro-batch 1 or 2 (measured: it needs
    # under 2000 MiB), while micro-batch 512 needs about 6 GiB more for activations: out of memory. Each
    # point is a process of its own, so the grid is kept to three (the product of axes is checked above).
    cfg = bench_config(tiny_run, tmp_path, memory_limit_mb=3000)
    # `diffpipe bench` runs here; each point is a process of its own, as from a shell.
    result = starter_in_process("bench", "-c", cfg, "--grid", "batch_size=1,2,512", "--grid", "precision=fp32")
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "run" / "bench"
    with open(out / "runs_summary.csv") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == COLUMNS
    assert [(r["batch_size"], r["precision"], r["status"]) for r in rows] == [
        ("1", "fp32", "ok"), ("2", "fp32", "ok"), ("512", "fp32", "oom")]
    for r in rows[:2]:
        assert float(r["samples_per_s_per_device"]) > 0 and float(r["peak_memory_mb"]) > 0
        assert 0 < float(r["step_time_p50_s"]) <= float(r["step_time_p95_s"])
        assert float(r["tflops_per_device"]) > 0 and float(r["flops_per_step"]) > 0
        assert r["mfu"] == ""  # no known peak for a CPU
        assert (r["resolution"], r["frames"], r["zero_stage"]) == ("32", "1", "0")
        # two measured steps after one warm-up step, in the point's own training log
        assert len(read_metrics(RunPaths(out / "points" / r["point"]).metrics)) == 3
    # twice the batch, twice the FLOPs of a step
    assert abs(float(rows[1]["flops_per_step"]) / float(rows[0]["flops_per_step"]) - 2) < 1e-5  # 6 digits in the CSV
    assert all("allocate memory" in r["error"] or "MemoryError" in r["error"] for r in rows[2:])
    with Image.open(out / "throughput_vs_memory.png") as img:
        assert img.size == (720, 440)
    fastest = min(rows[:2], key=lambda r: -float(r["samples_per_s_per_device"]))
    assert f"fastest point that fits: {fastest['point']}" in result.stderr
    assert f"batch_size: {fastest['batch_size']}" in result.stderr and "precision: fp32" in result.stderr
