"""Small PNG plots drawn with PIL (matplotlib is not a dependency): bench scatter and loss curves."""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw

from diffpipe.utils import atomic_path

COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (255, 127, 14), (148, 103, 189), (140, 86, 75),
          (227, 119, 194), (127, 127, 127)]
_PAD = 56


def _frame(title: str, xlabel: str, ylabel: str, size: tuple[int, int]):
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    w, h = size
    draw.text((_PAD, 10), title, fill="black")
    draw.rectangle([_PAD, _PAD, w - _PAD, h - _PAD], outline="gray")
    draw.text((w // 2 - 3 * len(xlabel), h - 22), xlabel, fill="black")
    draw.text((4, 30), ylabel, fill="black")
    return img, draw


def _scale(lo: float, hi: float, a: float, b: float):
    span = (hi - lo) or 1.0
    return lambda v: a + (v - lo) * (b - a) / span


def _ticks(draw, lo_x, hi_x, lo_y, hi_y, size):
    w, h = size
    draw.text((_PAD - 4, h - _PAD + 6), f"{lo_x:.4g}", fill="black")
    draw.text((w - _PAD - 24, h - _PAD + 6), f"{hi_x:.4g}", fill="black")
    draw.text((4, h - _PAD - 6), f"{lo_y:.4g}", fill="black")
    draw.text((4, _PAD - 6), f"{hi_y:.4g}", fill="black")


def scatter(points: list[tuple[float, float, str]], out: Path, *, title: str, xlabel: str, ylabel: str,
            size: tuple[int, int] = (720, 440)) -> Path:
    """Labelled points (x, y, label); the axes start at zero so ratios read true."""
    img, draw = _frame(title, xlabel, ylabel, size)
    w, h = size
    if points:
        hi_x = max(p[0] for p in points) * 1.1 or 1.0
        hi_y = max(p[1] for p in points) * 1.1 or 1.0
        sx, sy = _scale(0, hi_x, _PAD, w - _PAD), _scale(0, hi_y, h - _PAD, _PAD)
        for i, (x, y, label) in enumerate(points):
            cx, cy = sx(x), sy(y)
            color = COLORS[i % len(COLORS)]
            draw.ellipse([cx - 4, cy - 4, cx + 4, cy + 4], fill=color)
            draw.text((cx + 6, cy - 6), label, fill=color)
        _ticks(draw, 0, hi_x, 0, hi_y, size)
    return _save(img, out)


def lines(series: dict[str, list[float]], out: Path, *, title: str, xlabel: str, ylabel: str,
          size: tuple[int, int] = (720, 440)) -> Path:
    """One curve per label over its index (e.g. loss per step), with a legend."""
    img, draw = _frame(title, xlabel, ylabel, size)
    w, h = size
    values = [v for vs in series.values() for v in vs]
    if values:
        n = max(len(vs) for vs in series.values())
        lo, hi = min(values), max(values)
        sx, sy = _scale(1, max(n, 2), _PAD, w - _PAD), _scale(lo, hi, h - _PAD, _PAD)
        for i, (label, vs) in enumerate(series.items()):
            color = COLORS[i % len(COLORS)]
            if len(vs) >= 2:
                draw.line([(sx(j + 1), sy(v)) for j, v in enumerate(vs)], fill=color, width=2)
            draw.text((w - _PAD - 150, _PAD + 6 + 14 * i), f"-- {label}", fill=color)
        _ticks(draw, 1, n, lo, hi, size)
    return _save(img, out)


def _save(img: Image.Image, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        img.save(tmp, format="PNG", optimize=True)
    return out
