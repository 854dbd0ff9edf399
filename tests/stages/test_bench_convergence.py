"""``diffpipe bench --convergence``: precisions compared on the same data and seed, and what every
training log holds (FLOPs, TFLOPS, MFU, the profiler window). Through the CLI on the tiny SD model,
few steps; every point is a process of its own (a file apart from the grid's: see test_bench.py).
"""

from __future__ import annotations

import csv
import json

from PIL import Image
from stage_cli import starter_in_process
from tiny_runs import bench_config

from diffpipe.bench.plot import COLORS
from diffpipe.paths import RunPaths
from diffpipe.training.metrics import read_metrics


def test_convergence_overlays_the_loss_curves_and_training_logs_flops_and_a_profile(tiny_run, tmp_path):
    # Convergence points are plain `diffpipe train` runs (speed unmeasured, so train.profile is kept):
    # they also show the FLOPs, TFLOPS and MFU fields of every training log and the profiler window.
    cfg = bench_config(tiny_run, tmp_path, train={"peak_tflops": 0.5, "profile": {"skip": 1, "steps": 1}},
                  convergence_precisions=["fp32", "fp8"], convergence_steps=3)
    result = starter_in_process("bench", "-c", cfg, "--convergence")  # here; each point is a process
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "run" / "bench"
    rows = list(csv.DictReader((out / "convergence.csv").open()))
    assert [(r["name"], r["status"], r["precision"], r["base_weights"]) for r in rows] == [
        ("fp32", "ok", "fp32", "auto"), ("fp8", "ok", "bf16", "fp8")]
    assert float(rows[0]["final_loss_diff"]) == 0
    # same data and seed: close, but float8 weights move the loss
    assert 0 < abs(float(rows[1]["final_loss_diff"])) < 0.05 * float(rows[0]["final_loss"])
    runs = [RunPaths(out / "convergence" / "points" / r["point"]) for r in rows]
    losses = [[m["loss"] for m in read_metrics(paths.metrics)] for paths in runs]
    assert [len(c) for c in losses] == [3, 3] and losses[0] != losses[1]
    with Image.open(out / "convergence.png") as img:
        colors = {c for _, c in img.convert("RGB").getcolors(1 << 20)}
    assert COLORS[0] in colors and COLORS[1] in colors  # both curves drawn on one plot
    assert "fp8" in result.stderr and "vs fp32" in result.stderr

    paths = runs[0]
    metrics = read_metrics(paths.metrics)
    assert len({r["flops_per_step"] for r in metrics}) == 1 and metrics[0]["flops_per_step"] > 0  # one shape
    for r in metrics:
        assert abs(r["tflops_per_device"] - r["flops_per_step"] / r["step_time"] / 1e12) < 1e-9
        assert abs(r["mfu"] - r["tflops_per_device"] / 0.5) < 1e-9
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(paths.tensorboard))
    events.Reload()
    assert {"train/flops_per_step", "train/tflops_per_device", "train/mfu"} <= set(events.Tags()["scalars"])
    profile = paths.train_dir / "profile"
    trace = list((profile / "trace").glob("*.pt.trace.json"))
    assert len(trace) == 1 and json.loads(trace[0].read_text())["traceEvents"]
    ops = list(csv.DictReader((profile / "ops.csv").open()))
    assert len(ops) >= 10 and any("convolution" in r["op"] for r in ops)  # the UNet's convolutions
