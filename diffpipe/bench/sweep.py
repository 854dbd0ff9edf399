"""Run a sweep: each point in its own process, then the summary CSV, the plot and the fastest point."""

from __future__ import annotations

import csv
import io
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from diffpipe.bench import grid as g
from diffpipe.bench import plot
from diffpipe.bench.synthetic import encode_inputs
from diffpipe.config import Config, ConfigError
from diffpipe.families import get_family
from diffpipe.paths import RunPaths
from diffpipe.training.metrics import read_metrics
from diffpipe.utils import write_text_atomic

MARKER = ".diffpipe-bench"
MEASURES = ["status", "samples_per_s_per_device", "step_time_p50_s", "step_time_p95_s", "peak_memory_mb",
            "tflops_per_device", "mfu", "flops_per_step", "error"]
_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass
class BenchResult:
    rows: list[dict[str, Any]]
    csv: Path
    plot: Path
    best: dict[str, Any] | None = None
    best_config: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def prepare_out(out_dir: Path) -> Path:
    """``out_dir``, created and marked as ours; a non-empty folder diffpipe did not make is refused."""
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / MARKER).is_file():
        raise ConfigError(f"--out {out_dir}: the folder exists, is not empty and was not made by diffpipe bench; "
                          "choose another folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MARKER).touch()
    return out_dir


def run_point(spec: dict[str, Any], point_dir: Path, *, memory_limit_mb: int | None,
              timeout_s: float) -> dict[str, Any]:
    """Train one point in a child process; returns its status (``ok``, ``oom``, ``timeout``, ``error``)."""
    point_dir.mkdir(parents=True, exist_ok=True)
    spec_file, status_file = point_dir / "spec.json", point_dir / "status.json"
    write_text_atomic(spec_file, json.dumps(spec, indent=1))
    status_file.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}  # a fresh single-process run

    def cap() -> None:  # in the child, before it loads anything
        if memory_limit_mb:
            limit = memory_limit_mb * 2**20
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    with open(point_dir / "point.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "diffpipe.bench.point", str(spec_file)], stdout=log,
                                stderr=subprocess.STDOUT, env=env, preexec_fn=cap)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return {"status": "timeout", "error": f"stopped after {timeout_s:.0f} s"}
    if status_file.is_file():
        return json.loads(status_file.read_text())
    if rc == -signal.SIGKILL:  # the kernel's OOM killer, or a cap enforced by killing
        return {"status": "oom", "error": "killed (SIGKILL): out of memory"}
    tail = (point_dir / "point.log").read_text(errors="replace").strip().splitlines()[-1:] or [""]
    return {"status": "error", "error": f"exit code {rc}: {tail[0]}"}


def measure(metrics: Path, warmup: int) -> dict[str, Any]:
    """Throughput, step-time percentiles, memory and FLOPs of the measured steps (after ``warmup``)."""
    rows = [r for r in read_metrics(metrics) if "step_time" in r and r["step"] > warmup] if metrics.is_file() else []
    if not rows:
        return {}
    times = sorted(r["step_time"] for r in rows)
    samples = sum(r["samples_per_s"] * r["step_time"] for r in rows)
    out = {
        "samples_per_s_per_device": samples / sum(times),
        "step_time_p50_s": statistics.median(times),
        "step_time_p95_s": times[min(len(times) - 1, round(0.95 * (len(times) - 1)))],
        "peak_memory_mb": max(r["peak_memory_mb"] for r in rows),
    }
    flops = [r["flops_per_step"] for r in rows if "flops_per_step" in r]
    if flops:
        out["flops_per_step"] = flops[-1]
        out["tflops_per_device"] = flops[-1] / out["step_time_p50_s"] / 1e12
        peaks = [r["tflops_per_device"] / r["mfu"] for r in rows if r.get("mfu")]
        if peaks:
            out["mfu"] = out["tflops_per_device"] / peaks[-1]
    return out


def _specs(cfg: Config, pts: list[dict[str, Any]], out_dir: Path, steps: int, profile: bool):
    """(point, its config, (resolution, frames)) of every point; config errors before anything runs."""
    video = get_family(cfg.model).is_video
    specs = []
    for i, point in enumerate(pts):
        shape = g.data_shape(cfg, point, video)
        if cfg.bench.data == "cache" and ("resolution" in point or "frames" in point):
            raise ConfigError("bench axes resolution and frames shape synthetic batches; with bench.data: cache "
                              "the caches fix them (remove the axes or use bench.data: synthetic)")
        pcfg = g.point_config(cfg, point, output_dir=str(out_dir / "points" / f"p{i:03d}"), steps=steps,
                              profile=profile)
        specs.append((point, pcfg, shape))
    return specs


def sweep(cfg: Config, pts: list[dict[str, Any]], out_dir: Path, *, steps: int, warmup: int,
          console: Console | None, label: str = "bench", profile: bool = False) -> list[dict[str, Any]]:
    """Run every point; one row per point: its settings, measures and status (``profile``: keep
    ``train.profile``, for runs whose speed is not measured)."""
    specs = _specs(cfg, pts, out_dir, steps, profile)
    if cfg.bench.memory_limit_mb and _cuda():
        raise ConfigError("bench.memory_limit_mb caps a process's address space, which CUDA needs far more of "
                          "than memory; on a GPU leave it null (the GPU's memory is the cap)")
    inputs: dict[tuple[int, int], Path] = {}
    if cfg.bench.data == "synthetic":
        inputs = encode_inputs(cfg, sorted({s for _, _, s in specs}), out_dir / "inputs")
    rows = []
    columns = [TextColumn(f"{label} [progress.description]{{task.description}}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn()]
    with Progress(*columns, console=console or Console(stderr=True), transient=False) as progress:
        task = progress.add_task("", total=len(specs))
        for i, (point, pcfg, shape) in enumerate(specs):
            progress.update(task, description=", ".join(f"{k}={v}" for k, v in point.items()) or "config")
            spec = {"config": pcfg.model_dump(mode="json"), "data": cfg.bench.data,
                    "inputs": str(inputs.get(shape, "")), "cache_run": str(Path(cfg.output_dir).absolute())}
            point_dir = out_dir / "points" / f"p{i:03d}"
            status = run_point(spec, point_dir, memory_limit_mb=cfg.bench.memory_limit_mb,
                               timeout_s=cfg.bench.timeout_minutes * 60)
            row = {"point": f"p{i:03d}", **g.settings(pcfg, point, shape), **{m: "" for m in MEASURES}}
            row.update(status)
            if status["status"] == "ok":
                row.update(measure(RunPaths(pcfg.output_dir).metrics, warmup))
            row["_point"] = point
            rows.append(row)
            progress.advance(task)
    return rows


def write_csv(rows: list[dict[str, Any]], out: Path) -> Path:
    columns = [c for c in rows[0] if not c.startswith("_")]
    buf = io.StringIO()
    w = csv.DictWriter(buf, columns, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items() if k in columns})
    write_text_atomic(out, buf.getvalue())
    return out


def run_bench(cfg: Config, out_dir: Path, *, grid: dict[str, list[Any]] | None = None,
              console: Console | None = None) -> BenchResult:
    """Sweep ``cfg.bench.grid`` (axes in ``grid`` added or replaced): ``runs_summary.csv``, ``throughput.png``."""
    b = cfg.bench
    axes = {**b.grid, **(grid or {})}
    rows = sweep(cfg, g.points(axes), prepare_out(out_dir), steps=b.warmup_steps + b.steps, warmup=b.warmup_steps,
                 console=console)
    csv_path = write_csv(rows, out_dir / "runs_summary.csv")
    ok = [r for r in rows if r["status"] == "ok" and r.get("samples_per_s_per_device") != ""]
    png = plot.scatter([(r["peak_memory_mb"], r["samples_per_s_per_device"], _label(r)) for r in ok],
                       out_dir / "throughput_vs_memory.png", title=f"{cfg.model.family} bench: throughput vs "
                       "peak memory (ok points)", xlabel="peak memory per device (MiB)",
                       ylabel="samples/s per device")
    best = max(ok, key=lambda r: r["samples_per_s_per_device"], default=None)
    return BenchResult(rows, csv_path, png, best, g.config_lines(best["_point"]) if best else "")


def _label(row: dict[str, Any]) -> str:
    """A point's axis values, e.g. ``2,bf16`` (the point's name where no axis is swept)."""
    return ",".join(f"{v}" for v in row["_point"].values()) or row["point"]


def _cuda() -> bool:
    return torch.cuda.is_available()
