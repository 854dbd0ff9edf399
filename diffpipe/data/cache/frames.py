"""Video frame buckets: the model's frame-count rule and frame-rate resampling.

Pure functions; the plan uses them for items with more than one frame.
Video families encode ``4k+1`` frames (one key frame plus groups of four for
a VAE with 4x temporal compression), so a clip is resampled to the model's
frame rate and cut to the largest allowed count (or the largest configured
frame bucket) it holds. :func:`clip_windows` says which frames: the first
window, one window strided over the whole clip, or several windows (each its
own training item).
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


def resample_indices(n_src: int, src_fps: float, dst_fps: float, n_out: int, start: int = 0) -> list[int]:
    """Source frame indices for ``n_out`` frames at ``dst_fps`` (nearest earlier frame).

    Raises ValueError when the clip is too short: silently returning fewer
    frames would put the clip in the wrong bucket.
    """
    idx = [start + math.floor(i * src_fps / dst_fps + 1e-6) for i in range(n_out)]
    if n_out and idx[-1] >= n_src:
        raise ValueError(f"clip of {n_src} frames at {src_fps} fps is too short for {n_out} frames at {dst_fps} fps")
    return idx


def frame_bucket(n_src: int, src_fps: float, dst_fps: float, buckets: list[int] | None = None, *, step: int = 4,
                 offset: int = 1) -> int:
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


# -- which frames of a clip become training items (``datasets[].clip_windows``) ----------
WINDOW_MODES = ("first", "uniform", "multiple")


def window_starts(available: int, n: int, count: int | None = None) -> list[int]:
    """Starts of non-overlapping ``n``-frame windows spread evenly over ``available`` frames.

    As many windows as fit (at most ``count``); the first starts at frame 0 and
    the last ends at the clip's end. Consecutive starts differ by at least ``n``.
    """
    if n < 1 or available < n:
        return []
    k = available // n if count is None else min(count, available // n)
    if k <= 1:
        return [0]
    return [i * (available - n) // (k - 1) for i in range(k)]


def strided_indices(n_src: int, n_out: int) -> list[int]:
    """``n_out`` source frames at one even integer stride, centred, spanning as much of the clip as fits.

    Falls back to consecutive frames when the clip holds fewer than ``n_out`` (stride 1).
    """
    if n_out <= 1:
        return [0] * n_out
    stride = max(1, (n_src - 1) // (n_out - 1))
    start = max(0, (n_src - 1 - (n_out - 1) * stride) // 2)
    return [start + i * stride for i in range(n_out)]


def clip_windows(n_src: int, src_fps: float, dst_fps: float, buckets: list[int] | None = None, *, step: int = 4,
                 offset: int = 1, mode: str = "first", count: int | None = None) -> list[list[int]]:
    """The source frame indices of each training window of a clip (empty: too short for every bucket).

    Every window has the frame count :func:`frame_bucket` picks. ``mode``:

    - ``first``: one window, the clip's first frames at ``dst_fps``;
    - ``uniform``: one window spread over the whole clip at an even source-frame stride
      (so it shows the whole clip, faster than real time when the clip is longer than the window);
    - ``multiple``: non-overlapping windows at ``dst_fps`` spread evenly over the clip, as many as
      fit (at most ``count``); each becomes its own training item.
    """
    if mode not in WINDOW_MODES:
        raise ValueError(f"clip_windows {mode!r}: choose from {', '.join(WINDOW_MODES)}")
    n = frame_bucket(n_src, src_fps, dst_fps, buckets, step=step, offset=offset)
    if n == 0:
        return []
    if mode == "uniform":
        if n_src >= n:
            return [strided_indices(n_src, n)]
        return [resample_indices(n_src, src_fps, dst_fps, n)]  # a clip slower than dst_fps repeats frames
    if mode == "first":
        return [resample_indices(n_src, src_fps, dst_fps, n)]
    available = resampled_length(n_src, src_fps, dst_fps)
    every = resample_indices(n_src, src_fps, dst_fps, available)
    return [every[s : s + n] for s in window_starts(available, n, count)]
