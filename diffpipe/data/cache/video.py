"""The one video loader the latent cache uses: stream a clip, keep only the planned frames; write MP4s.

The plan picks which source frames a clip contributes (``frames.clip_windows`` on
the model's frame rate and frame rule: the first window, one strided window, or several). Decoding streams
through PyAV frame by frame, converts and crops only the frames it keeps,
writes them into a preallocated ``[3, F, H, W]`` array and stops after the
last one, so memory is set by the bucket, never by the clip's length. Each
frame goes through the same ``to_rgb`` and ``cover_crop`` as an image.

PyAV, Pillow and numpy only (no torch): safe in forked decoding workers.
:func:`write_mp4` writes samples and demo clips (H.264 when the installed PyAV has it).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import av
import numpy as np
from PIL import Image

from diffpipe.data.cache.buckets import cover_crop
from diffpipe.data.dataset.media import DEFAULT_MAX_PIXELS, decoded_frames, open_video, to_rgb


def select_frames(frames: Iterable[Any], indices: list[int]) -> Iterator[tuple[list[int], Any]]:
    """Yield ``(output positions, frame)`` for each wanted source frame, in order.

    ``indices`` are source frame numbers (non-decreasing; a number repeats when
    a clip is resampled to a higher frame rate). The source iterator is not
    advanced past the last wanted frame, so the rest of the clip is never decoded.
    """
    if not indices:
        return
    wanted: dict[int, list[int]] = {}
    for pos, idx in enumerate(indices):
        wanted.setdefault(idx, []).append(pos)
    last = max(wanted)
    for n, frame in enumerate(frames):
        if n in wanted:
            yield wanted[n], frame
        if n >= last:
            return


def load_video_array(
    src: str | Path | BinaryIO,
    size: tuple[int, int],
    frames: list[int],
    *,
    crop: tuple[float, float] = (0.5, 0.5),
    flip: bool = False,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> np.ndarray:
    """Decode source frames ``frames`` of a clip into float32 ``[3, F, H, W]`` in [-1, 1].

    Raises:
        ValueError: the clip has no video stream, declares frames of more than
            ``max_pixels`` (checked before decoding) or ends before the last planned frame.
    """
    h, w = size
    out = np.empty((3, len(frames), h, w), dtype=np.float32)
    filled = 0
    with open_video(src, max_pixels) as (container, stream):
        for positions, frame in select_frames(decoded_frames(container, stream, max_pixels), frames):
            rgb = cover_crop(to_rgb(frame.to_image()), (h, w), crop)
            if flip:
                rgb = rgb.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            arr = np.asarray(rgb, dtype=np.float32).transpose(2, 0, 1) / np.float32(127.5) - np.float32(1.0)
            for pos in positions:
                out[:, pos] = arr
            filled += len(positions)
    if filled != len(frames):
        raise ValueError(
            f"the clip ended after {filled} of the {len(frames)} planned frames (source frame {max(frames)} "
            "is missing); rerun the validate step"
        )
    return out


def video_codec() -> str:
    """The best codec the installed PyAV can write into MP4: H.264, else MPEG-4 Part 2."""
    return next(c for c in ("libx264", "libopenh264", "mpeg4") if c in av.codecs_available)


#: x264 settings that make its output repeatable: with its macroblock-tree rate control and lookahead,
#: the same frames gave one of 3 files in 40 encodes (and 2 different decoded clips).
REPEATABLE_X264 = {"x264-params": "mbtree=0:rc-lookahead=0"}


def write_mp4(frames: list[Image.Image], path: str | Path, fps: float, *, repeatable: bool = False) -> None:
    """Encode RGB frames (even sides) into an MP4 file with PyAV.

    ``repeatable``: the same frames always give the same file (demo clips that
    tests train on); see :data:`REPEATABLE_X264`.
    """
    w, h = frames[0].size
    codec = video_codec()
    options = REPEATABLE_X264 if repeatable and codec == "libx264" else None
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream(codec, rate=round(fps), options=options)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for img in frames:
            for packet in stream.encode(av.VideoFrame.from_image(img.convert("RGB"))):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
