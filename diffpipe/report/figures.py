"""The report's pictures as PNG bytes: loss, evaluation per timestep, speed and memory; sample tiles."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PIL import Image

from diffpipe.training.plots import finite_points, loss_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: Sampling steps shown in the report at most (evenly spaced, the last one always): a long run's
#: hundreds of sample rows would make the page hundreds of megabytes.
MAX_STEP_ROWS = 12
#: Sample images wider than this are shrunk for the page (the files keep their size).
MAX_TILE = 384
#: The sample stage's grid is shrunk to this width for the page (four 1024-pixel samples would be 4096).
MAX_GRID = 1600
_QUANTILE = re.compile(r"eval_loss_q([0-9.]+)$")


def png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def loss_png(rows: list[dict[str, Any]], objective: str) -> bytes | None:
    return png(loss_figure(rows, objective=objective)) if rows else None


def eval_png(rows: list[dict[str, Any]], objective: str) -> bytes | None:
    """The evaluation loss against the timestep quantile, one line per evaluation step (at most 6 of them,
    evenly spaced); None when the run did not evaluate."""
    # deferred: matplotlib costs a second of start-up
    from matplotlib.figure import Figure

    evals = {r["step"]: {float(m[1]): r[k] for k in r if (m := _QUANTILE.match(k)) and isinstance(r[k], (int, float))}
             for r in rows if "step" in r and any(_QUANTILE.match(k) for k in r)}
    if not evals:
        return None
    fig = Figure(figsize=(8, 3.6), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    for step in pick_steps(sorted(evals), 6):
        quantiles = sorted(evals[step])
        ax.plot(quantiles, [evals[step][q] for q in quantiles], marker="o", linewidth=1.2, label=f"step {step}")
    ax.set_xlabel("timestep quantile (low: little noise, high: much noise)")
    ax.set_ylabel(f"evaluation loss ({objective.upper() if objective == 'mse' else objective})")
    ax.set_title("evaluation loss per timestep quantile (same items and noise each time)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return png(fig)


def speed_png(rows: list[dict[str, Any]]) -> bytes | None:
    """Training throughput (samples/s) and peak memory (MiB) per step (None without metrics)."""
    # deferred: matplotlib costs a second of start-up
    from matplotlib.figure import Figure

    speed, memory = finite_points(rows, "samples_per_s"), finite_points(rows, "peak_memory_mb")
    if not speed[0] and not memory[0]:
        return None
    fig = Figure(figsize=(8, 3.4), dpi=100, layout="constrained")
    left, right = fig.subplots(1, 2)
    left.plot(*speed, color="#2b8a3e")
    left.set(xlabel="step (optimizer steps)", ylabel="throughput (samples/s, all processes)", title="throughput")
    right.plot(*memory, color="#862e9c")
    right.set(xlabel="step (optimizer steps)", ylabel="peak memory (MiB)", title="peak memory of the main process")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
    return png(fig)


def pick_steps(steps: list[int], limit: int = MAX_STEP_ROWS) -> list[int]:
    """At most ``limit`` of ``steps``, evenly spaced, always the first and the last."""
    if len(steps) <= limit:
        return list(steps)
    picked = {steps[round(i * (len(steps) - 1) / (limit - 1))] for i in range(limit)}
    return sorted(picked)


def _png_bytes(img: Image.Image) -> bytes:
    if img.width > MAX_TILE:
        img = img.resize((MAX_TILE, max(1, round(img.height * MAX_TILE / img.width))), Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    img.convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


def tiles(row_file: Path, count: int) -> list[bytes]:
    """A training sample row (``count`` images side by side) cut into one PNG per prompt; the whole row
    as one image when its width does not split into ``count`` equal parts."""
    with Image.open(row_file) as img:
        img.load()
    if count < 1 or img.width % count:
        return [_png_bytes(img)]
    w = img.width // count
    return [_png_bytes(img.crop((i * w, 0, (i + 1) * w, img.height))) for i in range(count)]


def file_png(path: Path, max_width: int | None = None) -> bytes:
    """A PNG file's bytes, shrunk to ``max_width`` when wider."""
    if max_width is None:
        return path.read_bytes()
    with Image.open(path) as img:
        img.load()
    if img.width <= max_width:
        return path.read_bytes()
    buf = io.BytesIO()
    img.resize((max_width, round(img.height * max_width / img.width)), Image.Resampling.LANCZOS).save(buf, "PNG")
    return buf.getvalue()
