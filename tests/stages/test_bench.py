"""``diffpipe bench`` sweeps, FLOPs/TFLOPS/MFU in training logs, the profiler window, precision convergence.

Each through the CLI on the tiny SD model, few steps: every bench point is a process of its own.
"""

from __future__ import annotations

import csv
import json

import yaml
from PIL import Image

from diffpipe.bench.grid import parse_grid_args, points
from diffpipe.bench.plot import COLORS
from diffpipe.bench.sweep import MEASURES
from diffpipe.paths import RunPaths
from diffpipe.training.metrics import read_metrics

COLUMNS = ["point", "batch_size", "precision", "base_weights", "activation_checkpointing", "compile",
           "attention_backend", "zero_stage", "resolution", "frames", *MEASURES]


def _config(tiny_run, tmp_path, train=None, **bench) -> str:
    cfg = tiny_run.config(tmp_path / "run", **(train or {}))
    cfg["bench"] = {"warmup_steps": 1, "steps": 2, **bench}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_grid_points_are_the_product_of_the_axes_the_first_varying_slowest():
    grid = parse_grid_args(["batch_size=1,512", "precision=fp32,bf16", "train.seed=7"])
    assert grid == {"batch_size": [1, 512], "precision": ["fp32", "bf16"], "train.seed": [7]}
    assert [tuple(p.values()) for p in points(grid)] == [
        (1, "fp32", 7), (1, "bf16", 7), (512, "fp32", 7), (512, "bf16", 7)]
    assert points({}) == [{}]


def test_grid_writes_every_column_and_a_plot_and_records_out_of_memory(tiny_run, cli, tmp_path):
    # Under a 3000 MiB address-space cap the tiny model trains at micro-batch 1 or 2 (measured: it needs
    # under 2000 MiB), while micro-batch 512 needs about 6 GiB more for activations: out of memory. Each
    # point is a process of its own, so the grid is kept to three (the product of axes is checked above).
    cfg = _config(tiny_run, tmp_path, memory_limit_mb=3000)
    result = cli("bench", "-c", cfg, "--grid", "batch_size=1,2,512", "--grid", "precision=fp32")
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


def test_convergence_overlays_the_loss_curves_and_training_logs_flops_and_a_profile(tiny_run, cli, tmp_path):
    # Convergence points are plain `diffpipe train` runs (speed unmeasured, so train.profile is kept):
    # they also show the FLOPs, TFLOPS and MFU fields of every training log and the profiler window.
    cfg = _config(tiny_run, tmp_path, train={"peak_tflops": 0.5, "profile": {"skip": 1, "steps": 1}},
                  convergence_precisions=["fp32", "fp8"], convergence_steps=3)
    result = cli("bench", "-c", cfg, "--convergence")
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
