"""Reading and decoding the cache jobs' media, a few batches ahead of the encoder.

Every file (or table cell) is checked against the sha256 the validate step recorded before it is
decoded: encoding changed content would store new pixels under the old content's key.
:func:`decode_item` cuts an item and its aux images (control, mask) to its bucket; it runs in worker
processes (:func:`decode_pool`) that :func:`prefetched` keeps busy while the encoder works.
:func:`control_image` reads a text entry's control image for the families whose text encoder sees it.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import multiprocessing
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from PIL import Image, ImageOps

from diffpipe.config import CONTROL_ROLES
from diffpipe.data.cache.buckets import load_image_array, load_mask_array
from diffpipe.data.cache.video import load_video_array
from diffpipe.data.dataset.media import DEFAULT_MAX_PIXELS, open_image, sha256_media, to_rgb
from diffpipe.data.dataset.tables import parse_locator, read_media

T = TypeVar("T")
R = TypeVar("R")

#: Batches decoded ahead of the encoder.
PREFETCH = 2
#: Fewer entries to encode than this many batches: decode in threads (no process start-up).
PROCESS_MIN_BATCHES = 4


def prefetched(batches: Iterable[list[T]], fn: Callable[[T], R], pool: Executor) -> Iterator[tuple[list[T], list[R]]]:
    """Yield ``(batch, [fn(x) for x in batch])`` with later batches already running.

    The first batches are submitted at once (not at the first ``next``), so
    decoding starts while the caller is still loading its encoder.
    """
    it = iter(batches)
    pending: deque = deque()
    for batch in itertools.islice(it, PREFETCH + 1):
        pending.append((batch, [pool.submit(fn, x) for x in batch]))

    def drain() -> Iterator[tuple[list[T], list[R]]]:
        while pending:
            batch, futures = pending.popleft()
            nxt = next(it, None)
            if nxt is not None:
                pending.append((nxt, [pool.submit(fn, x) for x in nxt]))
            yield batch, [f.result() for f in futures]

    return drain()


def read_checked(path: str, sha256: str, trust: bool, *, stream: bool = False) -> bytes | None:
    """A file's (or table cell's) bytes, after checking its planned sha256 unless trusted.

    ``stream``: a file is only hashed (None comes back) and its decoder reads it from
    disk; a table cell is always read into memory.
    """
    stream = stream and parse_locator(path) is None
    try:
        data = None if stream else read_media(path)
        sha = sha256_media(path) if data is None else hashlib.sha256(data).hexdigest()
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err}; rerun the validate step") from err
    if not trust and sha != sha256:
        # Encoding it would store new pixels under the old content's key.
        raise ValueError(f"{path} changed since validation (sha256 differs); rerun the workflow")
    return data


def source_order(item: dict[str, Any]) -> tuple[str, int]:
    """Where an item's bytes are: (file, row) for a table cell, (path, 0) for a file."""
    cell = parse_locator(item["path"])
    return (cell.file, cell.row) if cell else (item["path"], 0)


def decode_item(job: tuple[dict[str, Any], bool] | tuple[dict[str, Any], bool, int]) -> dict[str, np.ndarray]:
    """Read one item (and its aux images), check them against the planned sha256s, decode them.

    Returns ``pixels`` ``[3, F, H, W]`` and, when the item has them, ``control``
    ``[3, R, H, W]`` (its R reference images; 1 but for ``control_path`` lists) and
    ``mask`` ``[1, 1, H, W]``, all cut to the same bucket.
    Images are read into memory once (hash and decode); clips are hashed in
    blocks and streamed from disk, decoding only their planned frames. A file
    whose header declares more than ``max_pixels`` (the validated limit, from
    the spec) is refused before decoding, even when trusted.
    """
    item, trust, max_pixels = (*job, DEFAULT_MAX_PIXELS)[:3]
    path = item["path"]
    _, h, w = item["bucket"]
    crop, flip = tuple(item.get("crop", (0.5, 0.5))), item.get("flip", False)
    frames = item.get("frames")
    data = read_checked(path, item["sha256"], trust, stream=bool(frames))
    out: dict[str, np.ndarray] = {}
    try:
        if frames:
            src = Path(path) if data is None else io.BytesIO(data)
            out["pixels"] = load_video_array(src, (h, w), frames, crop=crop, flip=flip, max_pixels=max_pixels)
        else:
            out["pixels"] = load_image_array(io.BytesIO(data), (h, w), crop=crop, flip=flip, max_pixels=max_pixels)
    except Exception as err:
        raise ValueError(f"cannot decode {path}: {err}") from err
    for role, aux in sorted((item.get("aux") or {}).items()):
        if aux.get("first_frame"):  # the clip's own first frame, cut exactly like the clip
            out[role] = np.ascontiguousarray(out["pixels"][:, :1])
        else:
            aux_data = read_checked(aux["path"], aux["sha256"], trust)
            load = load_mask_array if role == "mask" else load_image_array
            try:
                out[role] = load(io.BytesIO(aux_data), (h, w), crop=crop, flip=flip, max_pixels=max_pixels)
            except Exception as err:
                raise ValueError(f"cannot decode the {role} image {aux['path']} of {path}: {err}") from err
        if aux.get("last_frame"):  # then the clip's own last frame: a control ``[3, 2, H, W]``
            out[role] = np.ascontiguousarray(np.concatenate([out[role], out["pixels"][:, -1:]], axis=1))
    if more := [out.pop(role) for role in CONTROL_ROLES[1:] if role in out]:
        # Several references: one control ``[3, R, H, W]``, reference k as frame k.
        out["control"] = np.ascontiguousarray(np.concatenate([out["control"], *more], axis=1))
    return out


def decode_pool(n_batches: int, workers: int) -> Executor:
    """Worker processes for real work; threads when only a few batches need decoding.

    Workers are forked before the encoder loads and decode with PIL and numpy
    only (no torch), so forking is safe and costs no start-up imports.
    """
    if workers > 0 and n_batches >= PROCESS_MIN_BATCHES:
        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
        return ProcessPoolExecutor(max_workers=workers, mp_context=ctx)
    return ThreadPoolExecutor(max_workers=max(1, workers))


def control_image(control: dict[str, str] | list[dict[str, str]], max_pixels: int) -> Image.Image | list[Image.Image]:
    """A text entry's control image as the RGB PIL image a user hands the family's pipeline (a list of
    them for an item with several references).

    Checked against its planned sha256 first: encoding it would otherwise store
    new pixels under the old content's key.
    """
    if isinstance(control, list):
        return [control_image(c, max_pixels) for c in control]
    data = read_checked(control["path"], control["sha256"], False)
    try:
        with open_image(io.BytesIO(data), max_pixels) as img:
            img.load()
            ImageOps.exif_transpose(img, in_place=True)
            return to_rgb(img)
    except Exception as err:
        raise ValueError(f"cannot decode the control image {control['path']}: {err}") from err
