"""A deterministic toy dataset: coloured shapes on plain backgrounds.

Used for the demo dataset shipped in ``config/demo_data/`` and by tests and
benchmarks that need N small captioned images without any download.
"""

from __future__ import annotations

import io
import random
from pathlib import Path

from PIL import Image, ImageDraw

from diffpipe.utils import claim_files, write_bytes_atomic, write_text_atomic

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 70, 210),
    "yellow": (235, 205, 40),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
SHAPES = ("circle", "square", "triangle")


def _draw_shape(
    draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], fill
) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=fill)


def demo_item(index: int, size: int = 64, seed: int = 0) -> tuple[Image.Image, str]:
    """The image and caption of item ``index`` (same inputs, same pixels)."""
    rng = random.Random(f"{seed}:{index}")
    # Cycle through shapes so even a small set holds each of them.
    shape = SHAPES[index % len(SHAPES)]
    names = list(COLORS)
    fg = rng.choice(names)
    bg = rng.choice([c for c in names if c != fg])
    img = Image.new("RGB", (size, size), COLORS[bg])
    side = rng.randint(size * 2 // 5, size * 3 // 4)
    x0 = rng.randint(0, size - side)
    y0 = rng.randint(0, size - side)
    _draw_shape(ImageDraw.Draw(img), shape, (x0, y0, x0 + side - 1, y0 + side - 1), COLORS[fg])
    return img, f"a {fg} {shape} on a {bg} background"


def write_demo_dataset(
    out_dir: str | Path, n: int = 16, size: int = 64, seed: int = 0
) -> list[Path]:
    """Write ``n`` PNG images with same-stem ``.txt`` captions; returns the image paths.

    A user's file under one of those names is refused, never overwritten (other
    files in ``out_dir`` are left alone). Not synced: toy data is rewritten in a second.
    """
    out = Path(out_dir)
    width = max(3, len(str(n - 1)))
    stems = [f"shape_{i:0{width}d}" for i in range(n)]
    claim_files(out, [f"{stem}{ext}" for stem in stems for ext in (".png", ".txt")])
    paths = []
    for i, name in enumerate(stems):
        img, caption = demo_item(i, size=size, seed=seed)
        stem = out / name
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        write_bytes_atomic(stem.with_suffix(".png"), buf.getvalue(), durable=False)
        write_text_atomic(stem.with_suffix(".txt"), caption + "\n", durable=False)
        paths.append(stem.with_suffix(".png"))
    return paths
