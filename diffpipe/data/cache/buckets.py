"""Aspect-ratio buckets and the one image loader every stage uses.

A bucket is a ``(H, W)`` pixel size whose area is close to ``resolution²``
and whose sides are multiples of the family's ``pixel_multiple``. Images go
to the bucket with the nearest aspect ratio, are resized to cover it and
cropped (center, or at a fixed per-item offset), so nothing is padded and
little is cut. The ratios are the classic nine (1:2 .. 2:1), ``count``
log-spaced ones between ``min_ar`` and ``max_ar``, or an explicit list.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from PIL import Image, ImageOps

# One RGB conversion for validation and caching; it lives with the media probes.
from diffpipe.data.dataset.media import DEFAULT_MAX_PIXELS, open_image, to_rgb

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


def _round_to(x: float, m: int) -> int:
    return max(m, int(round(x / m)) * m)


def log_spaced_ratios(min_ar: float, max_ar: float, count: int) -> tuple[float, ...]:
    """``count`` aspect ratios (width / height) evenly spaced in log space, ends included."""
    if count < 1 or min_ar <= 0 or max_ar < min_ar:
        raise ValueError(f"need 0 < min_ar <= max_ar and count >= 1, got {min_ar}, {max_ar}, {count}")
    if count == 1:
        return (math.sqrt(min_ar * max_ar),)
    lo, hi = math.log(min_ar), math.log(max_ar)
    return tuple(math.exp(lo + (hi - lo) * i / (count - 1)) for i in range(count))


def dataset_ratios(ds) -> tuple[float, ...] | None:
    """A DatasetConfig's bucket ratios: its explicit list, its log-spaced count, or None (classic)."""
    if ds.aspect_ratios:
        return tuple(sorted(ds.aspect_ratios))
    if ds.ar_buckets:
        return log_spaced_ratios(ds.min_ar, ds.max_ar, ds.ar_buckets)
    return None


@lru_cache(maxsize=64)
def bucket_sizes(
    resolution: int, pixel_multiple: int, ratios: tuple[float, ...] | None = None
) -> tuple[tuple[int, int], ...]:
    """The area-preserving ``(H, W)`` buckets for a resolution, from tallest to widest."""
    area = resolution * resolution
    if ratios is None:
        ratios = tuple(w / h for w, h in ASPECT_RATIOS)
    sizes: list[tuple[int, int]] = []
    for r in sorted(ratios):
        h = _round_to(math.sqrt(area / r), pixel_multiple)
        w = _round_to(math.sqrt(area * r), pixel_multiple)
        if (h, w) not in sizes:  # tiny resolutions collapse neighbouring ratios
            sizes.append((h, w))
    return tuple(sizes)


def choose_bucket(
    width: int,
    height: int,
    resolution: int,
    pixel_multiple: int,
    ratios: tuple[float, ...] | None = None,
) -> tuple[int, int]:
    """The ``(H, W)`` bucket whose aspect ratio is nearest (in log space) to the image's."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    target = math.log(width / height)
    return min(
        bucket_sizes(resolution, pixel_multiple, ratios),
        key=lambda hw: abs(math.log(hw[1] / hw[0]) - target),
    )


def crop_offset(seed: str) -> tuple[float, float]:
    """A fixed pseudo-random crop position ``(fy, fx)`` in [0, 1]² derived from ``seed``.

    Random crops are cached, so the offset must be a pure function of what the
    cache key holds (the item's content hash and bucket).
    """
    h = hashlib.sha256(seed.encode()).digest()
    return (int.from_bytes(h[:4], "big") / 0xFFFFFFFF, int.from_bytes(h[4:8], "big") / 0xFFFFFFFF)


def cover_crop(img: Image.Image, size: tuple[int, int], crop: tuple[float, float] = (0.5, 0.5)) -> Image.Image:
    """Resize to cover ``(H, W)`` preserving aspect, then crop (one resample).

    ``crop = (fy, fx)`` places the window within the spare height and width:
    0 = top/left, 0.5 = center, 1 = bottom/right.
    """
    out_h, out_w = size
    w, h = img.size
    scale = max(out_w / w, out_h / h)
    # The source window that maps onto the output; resampling only it avoids
    # an intermediate full-size resized image.
    src_w, src_h = out_w / scale, out_h / scale
    left, top = (w - src_w) * crop[1], (h - src_h) * crop[0]
    box = (left, top, left + src_w, top + src_h)
    return img.resize((out_w, out_h), Image.Resampling.LANCZOS, box=box, reducing_gap=3.0)


def crop_top_left(
    size: tuple[int, int], bucket: tuple[int, int], crop: tuple[float, float] = (0.5, 0.5), flip: bool = False
) -> tuple[int, int]:
    """Where :func:`cover_crop`'s window starts, ``(top, left)`` in pixels of the resized image.

    ``size`` is the source ``(H, W)``, ``bucket`` the output ``(H, W)``. SDXL's
    crop conditioning (Podell et al. 2023, section 2.2) is this offset. A
    flipped item is a crop of the mirrored image, whose window starts the
    mirrored distance from the left.
    """
    (h, w), (out_h, out_w) = size, bucket
    scale = max(out_w / w, out_h / h)
    spare_h, spare_w = h * scale - out_h, w * scale - out_w
    left = spare_w * crop[1]
    if flip:
        left = spare_w - left
    return round(spare_h * crop[0]), round(left)


def _fitted(src: str | Path | BinaryIO, channels: Callable[[Image.Image], Image.Image], size: tuple[int, int],
            crop: tuple[float, float], flip: bool, max_pixels: int) -> Image.Image:
    """The decoded image, upright (EXIF), as ``channels`` makes it, cover-cropped to ``size``, flipped if asked."""
    with open_image(src, max_pixels) as img:
        img.load()
        ImageOps.exif_transpose(img, in_place=True)
        out = cover_crop(channels(img), size, crop)
    return out.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else out


def load_image_array(src: str | Path | BinaryIO, size: tuple[int, int], *, crop: tuple[float, float] = (0.5, 0.5),
                     flip: bool = False, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """:func:`load_image` as numpy (no torch: safe in forked decoding workers).

    Raises:
        ValueError: the header declares more than ``max_pixels`` (nothing decoded).
    """
    arr = np.asarray(_fitted(src, to_rgb, size, crop, flip, max_pixels), dtype=np.float32)  # [H, W, 3]
    arr = arr.transpose(2, 0, 1)[:, None] / np.float32(127.5) - np.float32(1.0)
    return np.ascontiguousarray(arr, dtype=np.float32)


def mask_channel(img: Image.Image) -> Image.Image:
    """A mask image as one 8-bit channel: its alpha when it has a non-opaque one, else its luminance.

    Masks painted on a transparent layer carry the mask in alpha; black-and-white
    (or grayscale, or 16-bit) masks in their values (white = 1 = trained).
    """
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info:
        alpha = img.convert("RGBA").getchannel("A")
        if alpha.getextrema()[0] < 255:
            return alpha
    return to_rgb(img).convert("L")


def load_mask_array(src: str | Path | BinaryIO, size: tuple[int, int], *, crop: tuple[float, float] = (0.5, 0.5),
                    flip: bool = False, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Decode a mask into float32 ``[1, 1, H, W]`` in [0, 1], resized and cropped like its target.

    The same :func:`cover_crop` as the target (same bucket, crop position and
    flip), so a mask of the target's aspect ratio lines up at any resolution.
    Refused like :func:`load_image_array` when it declares more than ``max_pixels``.
    """
    arr = np.asarray(_fitted(src, mask_channel, size, crop, flip, max_pixels), dtype=np.float32) / np.float32(255.0)
    return np.ascontiguousarray(np.clip(arr, 0.0, 1.0)[None, None], dtype=np.float32)


def load_image(src: str | Path | BinaryIO, size: tuple[int, int], *, crop: tuple[float, float] = (0.5, 0.5),
               flip: bool = False, max_pixels: int = DEFAULT_MAX_PIXELS) -> torch.Tensor:
    """Decode an image into float32 ``[3, 1, H, W]`` in [-1, 1] for bucket ``(H, W)``."""
    return torch.from_numpy(load_image_array(src, size, crop=crop, flip=flip, max_pixels=max_pixels))
