"""The run's pictures: the loss plot has labelled axes and the eval curve; the sample grid's captions are legible."""

from __future__ import annotations

import numpy as np
from PIL import Image

from diffpipe.training import plots
from diffpipe.training.sample import _grid

PROMPTS = ["a red circle on a blue background with a very long tail of words that must wrap",
           "a yellow square on a black background"]


def _rows(n: int = 20) -> list[dict]:
    rows = [{"step": s, "loss": 1.0 / s} for s in range(1, n + 1)]
    rows[3]["loss"] = float("nan")  # a skipped step
    for s in (10, 20):
        rows[s - 1]["eval_loss"] = 0.5 / s
    return rows


def test_loss_plot_has_labelled_axes_and_the_eval_curve(tmp_path):
    fig = plots.loss_figure(_rows(), objective="mse")
    ax = fig.axes[0]
    assert ax.get_xlabel().startswith("step") and "MSE" in ax.get_ylabel()
    labels = [line.get_label() for line in ax.get_lines()]
    assert any("smoothed" in label for label in labels) and any("evaluation" in label for label in labels)
    eval_line = next(line for line in ax.get_lines() if "evaluation" in line.get_label())
    assert list(eval_line.get_xdata()) == [10, 20]
    assert 4 not in list(ax.get_lines()[0].get_xdata())  # the NaN step is left out
    assert len(ax.get_xticks()) > 2 and len(ax.get_yticks()) > 2
    out = plots.plot_loss(_rows(), tmp_path / "loss.png", objective="huber")
    img = np.asarray(Image.open(out).convert("RGB"))
    assert img.shape[1] >= 640 and len(np.unique(img.reshape(-1, 3), axis=0)) > 50


def test_grid_upscales_tiny_images_and_keeps_each_caption_in_its_column():
    """The old grid drew 64-pixel images with the prompt cut to 10 characters and labels running into
    the next column; now each column is >= 192 px, the gutter between columns holds no ink."""
    colours = [(200, 30, 30), (30, 30, 200)]
    base = [Image.new("RGB", (64, 64), c) for c in colours]
    tuned = [Image.new("RGB", (64, 64), tuple(255 - v for v in c)) for c in colours]
    grid = _grid(base, tuned, PROMPTS)
    px = np.asarray(grid)
    cell = plots.MIN_CELL
    assert grid.width >= 2 * cell
    # Images are scaled by nearest neighbour: the LoRA row's first cell is one flat colour, 192 px wide.
    ys, xs = np.nonzero((px == (55, 225, 225)).all(axis=2))
    assert xs.max() - xs.min() + 1 >= cell and ys.max() - ys.min() + 1 >= cell
    caption_top = ys.max() + 1
    gutter = slice(plots.GUTTER + cell, 2 * plots.GUTTER + cell)
    assert (px[caption_top:, gutter] == 255).all(), "caption text runs into the gutter between columns"
    assert (px[caption_top:, : plots.GUTTER // 2] == 255).all()
    # Some text under each column.
    for col in range(2):
        x0 = plots.GUTTER + col * (cell + plots.GUTTER)
        assert (px[caption_top:, x0:x0 + cell] < 128).any()


def test_wrap_breaks_long_prompts_and_ellipsizes():
    fnt = plots.font()
    lines = plots.wrap(PROMPTS[0], fnt, 180)
    from PIL import ImageDraw

    draw = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    assert 1 < len(lines) <= plots.CAPTION_LINES
    assert all(draw.textlength(line, font=fnt) <= 180 for line in lines)
    assert lines[-1].endswith("…")
    assert plots.wrap("x" * 200, fnt, 60, max_lines=10)[0] != "x" * 200  # a long token is cut, not spilled
    assert plots.wrap("short", fnt, 180) == ["short"]
