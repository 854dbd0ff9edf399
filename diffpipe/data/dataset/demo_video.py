"""Deterministic toy clips: a coloured shape moving across a plain background.

The video counterpart of :mod:`diffpipe.data.dataset.demo`, for the mixed image+video
demo (``config/demo-video.yaml``) and the video tests. Clips are written with
PyAV (H.264 when available, else MPEG-4 Part 2) with same-stem captions.
"""

from __future__ import annotations

import random
from pathlib import Path

from PIL import Image, ImageDraw

from diffpipe.data.cache.video import write_mp4
from diffpipe.data.dataset.demo import COLORS, SHAPES, _draw_shape
from diffpipe.utils import atomic_path, claim_files, write_text_atomic

DIRECTIONS = {"left to right": (1, 0), "right to left": (-1, 0), "top to bottom": (0, 1), "bottom to top": (0, -1)}


def demo_clip(
    index: int, *, frames: int = 9, width: int = 48, height: int = 32, seed: int = 0
) -> tuple[list[Image.Image], str]:
    """The frames and caption of clip ``index`` (same inputs, same pixels)."""
    rng = random.Random(f"clip:{seed}:{index}")
    shape = SHAPES[index % len(SHAPES)]
    names = list(COLORS)
    fg = rng.choice(names)
    bg = rng.choice([c for c in names if c != fg])
    direction = list(DIRECTIONS)[index % len(DIRECTIONS)]
    dx, dy = DIRECTIONS[direction]
    side = max(4, min(width, height) * 2 // 5)
    out = []
    for i in range(frames):
        f = i / max(1, frames - 1)  # 0 -> 1 over the clip
        cx = (width - side) * (f if dx > 0 else 1 - f if dx < 0 else 0.5)
        cy = (height - side) * (f if dy > 0 else 1 - f if dy < 0 else 0.5)
        img = Image.new("RGB", (width, height), COLORS[bg])
        x0, y0 = int(round(cx)), int(round(cy))
        _draw_shape(ImageDraw.Draw(img), shape, (x0, y0, x0 + side - 1, y0 + side - 1), COLORS[fg])
        out.append(img)
    return out, f"a {fg} {shape} moving {direction} on a {bg} background"


def write_clip(frames: list[Image.Image], path: str | Path, fps: float) -> Path:
    """Encode RGB frames into an MP4 file, atomically (the sides must be even).

    Repeatably: the same clip is the same file, so tests that write demo clips
    train on the same pixels every run (their golden losses depend on it).
    """
    with atomic_path(path, durable=False) as tmp:
        write_mp4(frames, tmp, fps, repeatable=True)
    return Path(path)


def write_demo_clips(
    out_dir: str | Path, n: int = 4, *, frames: int = 9, width: int = 48, height: int = 32, fps: float = 16,
    seed: int = 0,
) -> list[Path]:
    """Write ``n`` MP4 clips with same-stem ``.txt`` captions; returns the clip paths.

    As :func:`~diffpipe.data.dataset.demo.write_demo_dataset`: a user's file under one of
    those names is refused, never overwritten.
    """
    out = Path(out_dir)
    stems = [f"clip_{i:03d}" for i in range(n)]
    claim_files(out, [f"{stem}{ext}" for stem in stems for ext in (".mp4", ".txt")])
    paths = []
    for i, name in enumerate(stems):
        clip, caption = demo_clip(i, frames=frames, width=width, height=height, seed=seed)
        stem = out / name
        paths.append(write_clip(clip, stem.with_suffix(".mp4"), fps))
        write_text_atomic(stem.with_suffix(".txt"), caption + "\n", durable=False)
    return paths
