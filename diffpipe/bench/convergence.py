"""``diffpipe bench --convergence``: the same data and seed at several precisions and optimizers, loss curves
overlaid."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from diffpipe.bench import plot
from diffpipe.bench.sweep import BenchResult, prepare_out, sweep, write_csv
from diffpipe.config import Config
from diffpipe.paths import RunPaths
from diffpipe.training.metrics import read_metrics

#: A precision name -> the train settings it means (``fp8``: fp8 base weights computing in bf16).
PRECISIONS: dict[str, dict[str, Any]] = {
    "fp32": {"precision": "fp32", "base_weights": "auto"},
    "bf16": {"precision": "bf16", "base_weights": "auto"},
    "fp16": {"precision": "fp16", "base_weights": "auto"},
    "fp8": {"precision": "bf16", "base_weights": "fp8"},
}

#: An optimizer name -> the train settings it means (every one explicit, whatever the config says).
OPTIMIZERS: dict[str, dict[str, Any]] = {
    "adamw": {"train.optimizer": "adamw", "train.optimizer_in_backward": False},
    "adamw8bit": {"train.optimizer": "adamw8bit", "train.optimizer_in_backward": False},
    "adamw4bit": {"train.optimizer": "adamw4bit", "train.optimizer_in_backward": False},
    "adamw-in-backward": {"train.optimizer": "adamw", "train.optimizer_in_backward": True},
    "adamw8bit-in-backward": {"train.optimizer": "adamw8bit", "train.optimizer_in_backward": True},
    "adamw4bit-in-backward": {"train.optimizer": "adamw4bit", "train.optimizer_in_backward": True},
}


def convergence_points(precisions: list[str], optimizers: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """(name, point) for every precision and optimizer; a name says what varies (the precision alone while
    only plain ``adamw`` is compared, as before optimizers could be)."""
    out = []
    for prec in precisions:
        for opt in optimizers:
            if optimizers == ["adamw"]:
                name = prec
            else:
                name = opt if len(precisions) == 1 else f"{prec} {opt}"
            point = dict(PRECISIONS[prec])
            if optimizers != ["adamw"]:
                point.update(OPTIMIZERS[opt])
            out.append((name, point))
    return out


def final_loss(losses: list[float]) -> float:
    """Mean loss of the last tenth of the steps (at least one): less noisy than the last step alone."""
    tail = losses[-max(1, len(losses) // 10):]
    return sum(tail) / len(tail)


def run_convergence(cfg: Config, out_dir: Path, *, console: Console | None = None) -> BenchResult:
    """Train ``bench.convergence_steps`` steps per precision and optimizer; ``convergence.csv`` and
    ``convergence.png``."""
    b = cfg.bench
    named = convergence_points(b.convergence_precisions, b.convergence_optimizers)
    pts = [point for _, point in named]
    rows = sweep(cfg, pts, prepare_out(out_dir / "convergence"), steps=b.convergence_steps, warmup=0,
                 console=console, label="convergence", profile=True)  # losses only: a profile may run
    curves: dict[str, list[float]] = {}
    for (name, _), row in zip(named, rows, strict=True):
        row["name"] = name
        metrics = RunPaths(out_dir / "convergence" / "points" / row["point"]).metrics
        losses = [r["loss"] for r in read_metrics(metrics) if "loss" in r] if metrics.is_file() else []
        row["final_loss"] = final_loss(losses) if row["status"] == "ok" and losses else ""
        if row["final_loss"] != "":
            curves[name] = losses
    ref = next((r for r in rows if r["final_loss"] != ""), None)
    ref_name = ref["name"] if ref else None
    for row in rows:
        row["final_loss_diff"] = row["final_loss"] - ref["final_loss"] if ref and row["final_loss"] != "" else ""
    rows = [{"name": r.pop("name"), "final_loss": r.pop("final_loss"), "final_loss_diff": r.pop("final_loss_diff"),
             **r} for r in rows]
    csv_path = write_csv(rows, out_dir / "convergence.csv")
    what = "precision" if b.convergence_optimizers == ["adamw"] else "optimizer"
    png = plot.lines(curves, out_dir / "convergence.png", title=f"{cfg.model.family}: training loss by {what} "
                     f"(same data and seed; diff vs {ref_name})", xlabel="step", ylabel="loss")
    return BenchResult(rows, csv_path, png, extra={"reference": ref_name})
