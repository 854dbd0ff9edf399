"""The pictures a run leaves: the loss plot (``train/loss.png``) and the sample grid (``samples/grid.png``).

The loss plot is drawn with matplotlib (Agg, no display needed): ticks, labelled axes, the
training loss raw and smoothed, and the evaluation loss when the run evaluated. The grid puts
the base model's image above the LoRA's for every prompt, upscaled (nearest neighbour) when
tiny, with each prompt wrapped in a caption under its column at a legible size.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PIL import Image, ImageDraw, ImageFont

from diffpipe.utils import atomic_path

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: What the loss is, per ``train.objective.loss``, for the plot's y axis.
LOSS_LABELS = {
    "mse": "loss (MSE of the prediction vs. its target)",
    "huber": "loss (pseudo-Huber of the prediction vs. its target)",
}
#: The EMA weight of the smoothed curve on long runs (TensorBoard's slider at 0.9); a short run gets less,
#: so its smoothed curve does not lag many steps behind.
SMOOTHING = 0.9


def smoothing_weight(n: int) -> float:
    """The EMA weight for ``n`` points: :data:`SMOOTHING` from 100 points on, less below (0.6 at 25)."""
    return max(0.0, min(SMOOTHING, 1 - 10 / max(n, 1)))


def smoothed(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """Exponential moving average of ``values``, debiased so the first points are not pulled to zero."""
    out, ema = [], 0.0
    for i, v in enumerate(values, start=1):
        ema = weight * ema + (1 - weight) * v
        out.append(ema / (1 - weight**i))
    return out


def finite_points(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows holding a finite ``key`` (a skipped step's NaN loss is left out)."""
    pts = [(r["step"], float(r[key])) for r in rows
           if isinstance(r.get(key), (int, float)) and math.isfinite(r[key]) and "step" in r]
    return [s for s, _ in pts], [v for _, v in pts]


def loss_figure(rows: list[dict[str, Any]], *, objective: str = "mse") -> Figure:
    """The loss curves of ``metrics.jsonl`` rows: training loss (raw and smoothed) and evaluation loss."""
    # deferred: matplotlib costs a second of start-up; only the end of training and the report draw
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.2), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    steps, losses = finite_points(rows, "loss")
    if steps:
        ax.plot(steps, losses, color="#9db4e6", linewidth=1, label="training loss (per step)")
        weight = smoothing_weight(len(losses))
        ax.plot(steps, smoothed(losses, weight), color="#1f3fbf", linewidth=2,
                label=f"training loss (smoothed, EMA {weight:.2g})")
    eval_steps, evals = finite_points(rows, "eval_loss")
    if eval_steps:
        ax.plot(eval_steps, evals, color="#d9480f", marker="o", linewidth=1.5,
                label="evaluation loss (fixed items, timesteps and noise)")
    ax.set_xlabel("step (optimizer steps)")
    ax.set_ylabel(LOSS_LABELS.get(objective, f"loss ({objective})"))
    ax.set_title(f"loss over {len(steps)} steps" if steps else "no finite loss recorded")
    ax.grid(True, alpha=0.3)
    if steps or eval_steps:
        ax.legend(loc="upper right", fontsize="small")
    return fig


def save_figure(fig: Figure, out: str | Path) -> Path:
    """Write ``fig`` as a PNG, atomically."""
    out = Path(out)
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png")
    return out


def plot_loss(rows: list[dict[str, Any]], out: Path, *, objective: str = "mse") -> Path:
    """Draw the loss curves (:func:`loss_figure`) as a PNG: a quick look without TensorBoard."""
    return save_figure(loss_figure(rows, objective=objective), out)


# -- the sample grid -------------------------------------------------------------------------
#: Images narrower than this are upscaled (nearest neighbour, whole factors) so a 64-pixel sample
#: is visible and its caption has room.
MIN_CELL = 192
CAPTION_SIZE = 14
CAPTION_LINES = 3
GUTTER = 8


def font(size: int = CAPTION_SIZE) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    """Pillow's bundled scalable font at ``size`` pixels (its bitmap font where FreeType is missing)."""
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, OSError, ImportError):
        return ImageFont.load_default()


def wrap(text: str, fnt, width: int, max_lines: int = CAPTION_LINES) -> list[str]:
    """``text`` broken into lines at most ``width`` pixels wide; past ``max_lines``, the last one ends in '…'.

    A word longer than a line is cut (a long token must not spill into the next column).
    """
    draw = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    fits = lambda s: draw.textlength(s, font=fnt) <= width  # noqa: E731
    lines: list[str] = []
    line = ""
    for word in " ".join(text.split()).split(" "):
        candidate = f"{line} {word}".strip()
        if fits(candidate):
            line = candidate
            continue
        if line:
            lines.append(line)
        line = word
        while not fits(line) and len(line) > 1:  # cut a word wider than the column
            cut = len(line) - 1
            while cut > 1 and not fits(line[:cut]):
                cut -= 1
            lines.append(line[:cut])
            line = line[cut:]
    if line:
        lines.append(line)
    if len(lines) > max_lines:
        last = lines[max_lines - 1]
        while last and not fits(last + "…"):
            last = last[:-1]
        lines = [*lines[: max_lines - 1], last.rstrip() + "…"]
    return lines


def _scaled(img: Image.Image, cell: int) -> Image.Image:
    w, h = img.size
    factor = max(1, math.ceil(cell / w)) if w < cell else 1
    return img.resize((w * factor, h * factor), Image.Resampling.NEAREST) if factor > 1 else img


def caption_grid(rows: list[tuple[str, list[Image.Image]]], captions: list[str]) -> Image.Image:
    """Images in labelled rows (``(label, images)``, one image per column), each column's caption under it.

    Columns are at least :data:`MIN_CELL` pixels wide, apart by a gutter no text enters.
    """
    label_font, cap_font = font(CAPTION_SIZE + 2), font(CAPTION_SIZE)
    scaled = [(label, [_scaled(img.convert("RGB"), MIN_CELL) for img in images]) for label, images in rows]
    cols = len(captions)
    cell_w = max(img.size[0] for _, images in scaled for img in images)
    cell_h = max(img.size[1] for _, images in scaled for img in images)
    line_h = CAPTION_SIZE + 4
    label_h = line_h + 6
    wrapped = [wrap(c, cap_font, cell_w - 4) for c in captions]
    caption_h = max(len(w) for w in wrapped) * line_h + 8
    width = cols * cell_w + (cols + 1) * GUTTER
    grid = Image.new("RGB", (width, len(scaled) * (label_h + cell_h) + caption_h + GUTTER), "white")
    draw = ImageDraw.Draw(grid)
    y = 0
    for label, images in scaled:
        draw.text((GUTTER, y + 3), label, fill="black", font=label_font)
        y += label_h
        for col, img in enumerate(images):
            grid.paste(img, (GUTTER + col * (cell_w + GUTTER), y))
        y += cell_h
    for col, lines in enumerate(wrapped):
        x = GUTTER + col * (cell_w + GUTTER) + 2
        for i, line in enumerate(lines):
            draw.text((x, y + 4 + i * line_h), line, fill="black", font=cap_font)
    return grid
