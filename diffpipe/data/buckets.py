"""Aspect-ratio buckets and the one image loader every stage uses.

A bucket is a ``(H, W)`` pixel size whose area is close to ``resolution²``
and whose sides are multiples of the family's ``pixel_multiple``. Images go
to the bucket with the nearest aspect ratio, are resized to cover it and
center-cropped, so nothing is padded and little is cut.
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from PIL import Image, ImageOps

#: Width:height ratios of the buckets, from portrait 1:2 to landscape 2:1.
ASPECT_RATIOS: tuple[tuple[int, int], ...] = (
    (1, 2),
    (9, 16),
    (2, 3),
    (3, 4),
    (1, 1),
    (4, 3),
    (3, 2),
    (16, 9),
    (2, 1),
)

_INT_MODES = {"I", "I;16", "I;16L", "I;16B", "I;16N"}


def _round_to(x: float, m: int) -> int:
    return max(m, int(round(x / m)) * m)


@lru_cache(maxsize=64)
def bucket_sizes(resolution: int, pixel_multiple: int) -> tuple[tuple[int, int], ...]:
    """The ``(H, W)`` buckets for a resolution, ordered from tallest to widest."""
    area = resolution * resolution
    sizes: list[tuple[int, int]] = []
    for w_ratio, h_ratio in ASPECT_RATIOS:
        r = w_ratio / h_ratio
        h = _round_to(math.sqrt(area / r), pixel_multiple)
        w = _round_to(math.sqrt(area * r), pixel_multiple)
        if (h, w) not in sizes:  # tiny resolutions collapse neighbouring ratios
            sizes.append((h, w))
    return tuple(sizes)


def choose_bucket(width: int, height: int, resolution: int, pixel_multiple: int) -> tuple[int, int]:
    """The ``(H, W)`` bucket whose aspect ratio is nearest (in log space) to the image's."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    target = math.log(width / height)
    return min(
        bucket_sizes(resolution, pixel_multiple),
        key=lambda hw: abs(math.log(hw[1] / hw[0]) - target),
    )


def to_rgb(img: Image.Image) -> Image.Image:
    """Convert any Pillow mode to 8-bit RGB the same way everywhere.

    Transparency is composited over white (a palette image with a transparent
    index, LA, RGBA and PA alike); 16/32-bit integer images are scaled to
    8 bits instead of clipped, which Pillow's plain ``convert`` would do.
    """
    if img.mode in _INT_MODES:
        # Integer images come from 16-bit files (PNG, TIFF): map 0..65535 to 0..255.
        arr = np.asarray(img, dtype=np.float64)
        img = Image.fromarray(np.clip(arr / 257.0, 0, 255).round().astype(np.uint8), "L")
    elif img.mode == "F":
        arr = np.asarray(img, dtype=np.float64)
        img = Image.fromarray(np.clip(arr, 0, 255).round().astype(np.uint8), "L")
    has_alpha = img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info
    if has_alpha:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img if img.mode == "RGB" else img.convert("RGB")


def cover_crop(img: Image.Image, size: tuple[int, int]) -> Image.Image:
    """Resize to cover ``(H, W)`` preserving aspect, then center crop (one resample)."""
    out_h, out_w = size
    w, h = img.size
    scale = max(out_w / w, out_h / h)
    # The source window that maps onto the output; resampling only it avoids
    # an intermediate full-size resized image.
    src_w, src_h = out_w / scale, out_h / scale
    left, top = (w - src_w) / 2, (h - src_h) / 2
    box = (left, top, left + src_w, top + src_h)
    return img.resize((out_w, out_h), Image.Resampling.LANCZOS, box=box, reducing_gap=3.0)


def load_image(src: str | Path | BinaryIO, size: tuple[int, int]) -> torch.Tensor:
    """Decode an image into float32 ``[3, 1, H, W]`` in [-1, 1] for bucket ``(H, W)``."""
    with Image.open(src) as img:
        img.load()
        ImageOps.exif_transpose(img, in_place=True)
        rgb = cover_crop(to_rgb(img), size)
    arr = np.asarray(rgb, dtype=np.float32)  # [H, W, 3]
    t = torch.from_numpy(arr).permute(2, 0, 1).unsqueeze(1)
    return t.div_(127.5).sub_(1.0).contiguous()
