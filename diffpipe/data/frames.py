"""Video frame buckets: the model's frame-count rule and frame-rate resampling.

Pure functions; the plan uses them for items with more than one frame.
Video families encode ``4k+1`` frames (one key frame plus groups of four for
a VAE with 4x temporal compression), so a clip is resampled to the model's
frame rate and cut to the largest allowed count (or the largest configured
frame bucket) it holds.
"""

from __future__ import annotations

import math


def valid_frame_count(n: int, step: int = 4, offset: int = 1) -> bool:
    """Whether ``n`` frames satisfy the rule ``n = step * k + offset`` (k >= 0)."""
    return n >= offset and (n - offset) % step == 0


def snap_frames(n: int, step: int = 4, offset: int = 1) -> int:
    """The largest count ``<= n`` that satisfies the rule; 0 when none does."""
    if n < offset:
        return 0
    return offset + (n - offset) // step * step


def resampled_length(n_src: int, src_fps: float, dst_fps: float) -> int:
    """Frames available after resampling ``n_src`` frames from ``src_fps`` to ``dst_fps``."""
    if src_fps <= 0 or dst_fps <= 0:
        raise ValueError(f"frame rates must be positive, got {src_fps} and {dst_fps}")
    duration = n_src / src_fps
    # A small tolerance: 10 s at 30 fps is exactly 240 frames at 24 fps, not 239.
    return max(0, math.floor(duration * dst_fps + 1e-6))


def resample_indices(
    n_src: int, src_fps: float, dst_fps: float, n_out: int, start: int = 0
) -> list[int]:
    """Source frame indices for ``n_out`` frames at ``dst_fps`` (nearest earlier frame).

    Raises ValueError when the clip is too short: silently returning fewer
    frames would put the clip in the wrong bucket.
    """
    idx = [start + math.floor(i * src_fps / dst_fps + 1e-6) for i in range(n_out)]
    if n_out and idx[-1] >= n_src:
        raise ValueError(
            f"clip of {n_src} frames at {src_fps} fps is too short for {n_out} frames at {dst_fps} fps"
        )
    return idx


def frame_bucket(
    n_src: int,
    src_fps: float,
    dst_fps: float,
    buckets: list[int] | None = None,
    *,
    step: int = 4,
    offset: int = 1,
) -> int:
    """Frames a clip is cut to: the largest valid bucket it holds after resampling.

    ``buckets`` are snapped to the rule first; without buckets, the longest
    valid count. Returns 0 when the clip is shorter than every bucket (the
    plan reports such clips instead of dropping them silently).
    """
    available = resampled_length(n_src, src_fps, dst_fps)
    if buckets:
        allowed = sorted({snap_frames(b, step, offset) for b in buckets} - {0})
        fitting = [b for b in allowed if b <= available]
        return fitting[-1] if fitting else 0
    return snap_frames(available, step, offset)
