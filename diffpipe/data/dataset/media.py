"""Media probing: hash, identify and decode one file, the same way every stage sees it.

:func:`probe` is what validation's worker processes run per file: it reads
the bytes once (SHA-256), sniffs the real format from the magic bytes,
checks the size the header declares (:mod:`diffpipe.data.dataset.headers`; for a
video, the stream's frame size) against ``validation.max_pixels`` before
any decoder runs, and then fully decodes, because truncation only shows on
a full decode. Videos are decoded frame by frame with PyAV: the frame count
and fps are measured, never taken from container metadata.
:func:`open_image` and :func:`open_video` are the same guarded opening for
the cache jobs. :func:`to_rgb` is the one conversion to 8-bit RGB (also
used by the caches through ``buckets``).

Only Pillow and numpy are imported at module level (PyAV when a video is
decoded), so the validate command starts fast.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from diffpipe.data.dataset.headers import declared_size, sniff  # noqa: F401  (sniff: part of this module's API)
from diffpipe.data.dataset.tables import parse_locator, read_media

_INT_MODES = {"I", "I;16", "I;16L", "I;16B", "I;16N"}
#: Pillow's own limit (``Image.MAX_IMAGE_PIXELS``) and ``validation.max_pixels``'s default: the
#: cache decoders' limit when a spec does not carry the validated one.
DEFAULT_MAX_PIXELS = 178_956_970
#: Larger images (or video frames) are kept with a ``large_media`` warning: 4096 x 4096, four
#: times the pixels of a 2048 px bucket, and every cache job decodes the whole image to cut one.
LARGE_PIXELS = 4096 * 4096
#: Files above this are hashed in blocks and decoded from disk instead of memory.
_IN_MEMORY = 256 << 20

#: Extension -> the format family its content should have.
EXT_FORMAT = {
    ".png": "png",
    ".jpg": "jpeg",
    ".jpeg": "jpeg",
    ".gif": "gif",
    ".webp": "webp",
    ".bmp": "bmp",
    ".tif": "tiff",
    ".tiff": "tiff",
    ".mp4": "mp4",
    ".m4v": "mp4",
    ".mov": "mp4",
    ".mkv": "matroska",
    ".webm": "matroska",
    ".avi": "avi",
}
_IMAGE_FORMATS = {"png", "jpeg", "webp", "bmp", "tiff"}
_VIDEO_FORMATS = {"mp4", "matroska", "avi"}


def to_rgb(img: Image.Image) -> Image.Image:
    """Convert any Pillow mode to 8-bit RGB the same way everywhere.

    Transparency is composited over white (a palette image with a transparent
    index, LA, RGBA and PA alike); 16/32-bit integer images are scaled to
    8 bits instead of clipped, which Pillow's plain ``convert`` would do;
    CMYK and YCbCr go through Pillow's conversion.
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


@dataclass
class Probe:
    """What one file's content says: hash, kind, geometry, and problems (code, sentence)."""

    sha256: str | None = None
    kind: str | None = None  # "image" | "video"
    width: int | None = None
    height: int | None = None
    frames: int | None = None
    fps: float | None = None
    problems: list[tuple[str, str]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


def media_input(path: str) -> str | BinaryIO:
    """What a decoder opens for a manifest path: the file path, or a table cell's bytes in memory."""
    return io.BytesIO(read_media(path)) if parse_locator(path) else path


def sha256_media(path: str) -> str:
    """SHA-256 of a media file or table cell (a file is hashed in blocks)."""
    if parse_locator(path):
        return hashlib.sha256(read_media(path)).hexdigest()
    return _read(path, _IN_MEMORY + 1)[1]


def _read(path: str, size_hint: int) -> tuple[bytes | None, str]:
    """(content or None when large, sha256)."""
    if parse_locator(path):  # a table cell: in memory already
        data = read_media(path)
        return data, hashlib.sha256(data).hexdigest()
    if size_hint <= _IN_MEMORY:
        with open(path, "rb") as f:
            data = f.read()
        return data, hashlib.sha256(data).hexdigest()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return None, h.hexdigest()


class TooLarge(ValueError):
    """A file declares more pixels than the limit; nothing of it was decoded."""

    def __init__(self, message: str, width: int | None = None, height: int | None = None):
        super().__init__(message)
        self.width, self.height = width, height


def _too_large(what: str, w: int, h: int, max_pixels: int) -> TooLarge:
    return TooLarge(
        f"{what} is {w}x{h} = {w * h:,} pixels, over validation.max_pixels={max_pixels:,}; not decoded", w, h
    )


def check_header(src: str | Path | BinaryIO, max_pixels: int) -> None:
    """Raise :class:`TooLarge` when the header declares more than ``max_pixels`` (any frame or page)."""
    if isinstance(src, str | Path):
        with open(src, "rb") as f:
            found = declared_size(f)
    else:
        found = declared_size(src)
    if found and found[1] * found[2] > max_pixels:
        fmt, w, h = found
        what = "the GIF's screen with its frames" if fmt == "gif" else f"the {fmt.upper()} image"
        raise _too_large(what, w, h, max_pixels)


@contextmanager
def open_image(src: str | Path | BinaryIO, max_pixels: int) -> Iterator[Image.Image]:
    """``Image.open`` (which reads only the header) after :func:`check_header`; Pillow's size is
    checked as well, for formats the header reader does not know.

    Raises:
        TooLarge: the image declares more than ``max_pixels``; nothing was decoded.
    """
    check_header(src, max_pixels)
    try:
        img = Image.open(src)
    except Image.DecompressionBombError as err:  # over twice Pillow's own limit
        raise TooLarge(f"{err}; not decoded") from None
    with img:
        w, h = img.size
        if w * h > max_pixels:
            raise _too_large("the image", w, h, max_pixels)
        yield img


@contextmanager
def open_video(src: str | Path | BinaryIO, max_pixels: int) -> Iterator[tuple[Any, Any]]:
    """A PyAV container and its first video stream, checked before any frame is decoded.

    The stream's declared frame size (and a GIF's frames, from its header)
    must fit in ``max_pixels``. FFmpeg gets its own ``max_pixels`` too, for
    the stream probing of ``av.open`` (which decodes a first frame for some
    codecs, H.264 among them) and for the decoder, so frames that grow past
    the declared size mid-stream fail instead of being allocated (with a
    margin: see :func:`_ffmpeg_limit`; :func:`decoded_frames` holds each
    frame to the exact limit).

    Raises:
        TooLarge: a frame would have more than ``max_pixels``.
        ValueError: the file holds no video stream.
    """
    check_header(src, max_pixels)
    import av  # after the header check: a refused GIF costs no import

    where = str(src) if isinstance(src, Path) else src
    limit = {"max_pixels": str(_ffmpeg_limit(max_pixels))}
    with av.open(where, options=limit) as container:  # FFmpeg's stream probing decodes within it too
        stream = next((s for s in container.streams if s.type == "video"), None)
        if stream is None:
            raise ValueError("the file holds no video stream")
        ctx = stream.codec_context
        w, h = ctx.width, ctx.height
        if not (w and h):  # the probe refused the size: read it as it is, for the message
            w, h = _stream_size(src)
        if w * h > max_pixels:
            raise _too_large("a frame of the video stream", w, h, max_pixels)
        ctx.options = {**ctx.options, **limit}
        yield container, stream


def _stream_size(src: str | Path | BinaryIO) -> tuple[int, int]:
    """The first video stream's declared frame size, probed without a limit."""
    import av  # deferred: PyAV takes ~0.5 s to import; image-only datasets never open a video

    if not isinstance(src, str | Path):
        src.seek(0)
    with av.open(str(src) if isinstance(src, Path) else src) as container:
        ctx = next(s for s in container.streams if s.type == "video").codec_context
        size = ctx.width, ctx.height
    if not isinstance(src, str | Path):
        src.seek(0)
    return size


def _ffmpeg_limit(max_pixels: int) -> int:
    """The decoder's own allocation limit: FFmpeg applies ``max_pixels`` to its padded work
    buffers too (a 32x32 MPEG-4 clip fails under 200,000), so it gets a margin; an int."""
    return min(max(4 * max_pixels, 1 << 24), 2**31 - 1)


def decoded_frames(container: Any, stream: Any, max_pixels: int) -> Iterator[Any]:
    """The stream's decoded frames; :class:`TooLarge` at a frame over ``max_pixels`` (a stream
    may change its size after the header)."""
    for frame in container.decode(stream):
        if frame.width * frame.height > max_pixels:
            raise _too_large("a decoded frame", frame.width, frame.height, max_pixels)
        yield frame


def _probe_image(src: Any, p: Probe, max_pixels: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with open_image(src, max_pixels) as img:
            w, h = img.size
            if img.format == "JPEG":
                # DCT-domain downscale still walks the whole stream (truncation is
                # caught) at a fraction of the decode cost.
                img.draft("RGB", (max(1, w // 8), max(1, h // 8)))
            img.load()
            to_rgb(img)  # the conversion the caches will do must work
            orientation = img.getexif().get(0x0112, 1)
    if orientation in (5, 6, 7, 8):  # what ImageOps.exif_transpose does to the size
        w, h = h, w
    p.width, p.height, p.frames = w, h, 1


def _probe_video(src: Any, p: Probe, max_pixels: int) -> None:
    n, first, last = 0, None, None
    with open_video(src, max_pixels) as (container, stream):
        import av  # imported by open_video

        try:
            for frame in decoded_frames(container, stream, max_pixels):
                if n == 0:
                    p.width, p.height = frame.width, frame.height
                    first = frame.time
                last = frame.time
                n += 1
        except av.error.FFmpegError as err:
            error = f": {_reason(err)}"
            if n:
                p.problems.append(("corrupt_media", f"decoding stopped after {n} frame(s){error}"))
        else:
            error = ""
    p.frames = n
    if n > 1 and first is not None and last is not None and last > first:
        p.fps = round((n - 1) / (last - first), 3)
    if n == 0:
        p.problems.append(("no_frames", f"the video stream has no decodable frame{error}"))


def _large(p: Probe) -> None:
    """Flag ``large_media``: kept, but slow to cache (a sentence with the size)."""
    w, h = p.width or 0, p.height or 0
    if w * h > LARGE_PIXELS:
        what = f"the video's frames are {w}x{h}" if p.kind == "video" else f"the image is {w}x{h}"
        p.problems.append(
            (
                "large_media",
                f"{what} = {w * h / 1e6:.1f} megapixels, over {LARGE_PIXELS / 1e6:.1f} (4096x4096): kept, but "
                "each cache job decodes all of it to cut one bucket; a downscaled copy caches faster",
            )
        )


def _reason(err: Exception) -> str:
    """An error as a stable sentence: no object addresses or placeholder file names."""
    if isinstance(err, UnidentifiedImageError):
        return "the content is not in any image format Pillow reads"
    return (
        re.sub(r"(: )?'<none>'|<_io\.BytesIO object at 0x[0-9a-f]+>", "", str(err)).strip()
        or type(err).__name__
    )


def probe(path: str, ext_kind: str, max_pixels: int) -> Probe:
    """Hash and check one media file; ``ext_kind`` is the kind its extension says."""
    p = Probe()
    cell = parse_locator(path)
    try:
        size = 0 if cell else os.stat(path).st_size
        data, p.sha256 = _read(path, size)
        size = len(data) if cell and data is not None else size
    except OSError as err:
        p.problems.append(("unreadable", f"cannot read the file: {err.strerror or err}"))
        return p
    if size == 0:
        p.problems.append(("zero_byte", "the file is empty (0 bytes)"))
        return p
    if data is not None:
        head = data[:32]
    else:
        with open(path, "rb") as f:
            head = f.read(32)
    found = sniff(head)
    expected = None if cell else EXT_FORMAT.get(os.path.splitext(path)[1].lower())
    if found and expected and found != expected:
        p.problems.append(
            (
                "extension_mismatch",
                f"the extension says {expected.upper()} but the content is {found.upper()}",
            )
        )
    kind = "image" if found in _IMAGE_FORMATS else "video" if found in _VIDEO_FORMATS else ext_kind
    p.kind = kind
    src = io.BytesIO(data) if data is not None else path
    try:
        if kind == "video":
            _probe_video(src, p, max_pixels)
        else:
            _probe_image(src, p, max_pixels)
    except TooLarge as err:
        p.problems.append(("decompression_bomb", str(err)))
        p.width, p.height, p.frames, p.fps = err.width, err.height, None, None
    except Exception as err:  # PIL: OSError, SyntaxError, ValueError...; PyAV: FFmpegError
        what = "video" if kind == "video" else "image"
        p.problems.append(("corrupt_media", f"cannot decode the {what}: {_reason(err)}"))
        p.width = p.height = p.frames = p.fps = None
    else:
        _large(p)
    return p


def probe_many(jobs: list[tuple[str, str]], max_pixels: int) -> list[dict[str, Any]]:
    """Worker entry point: probe a chunk of ``(path, ext_kind)``."""
    return [probe(path, kind, max_pixels).as_dict() for path, kind in jobs]


def thumbnail(path: str, kind: str | None, size: int, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image | None:
    """An RGB thumbnail (the first frame of a video), None when it cannot be decoded.

    Opened like every other decode (:func:`open_image`, :func:`open_video`):
    a file flagged as a decompression bomb gets no thumbnail.
    """
    try:
        if kind == "video":
            with open_video(media_input(path), max_pixels) as (container, stream):
                img = next(decoded_frames(container, stream, max_pixels)).to_image()
        else:
            with open_image(media_input(path), max_pixels) as src:
                src.draft("RGB", (size, size))
                src.load()
                img = to_rgb(ImageOps.exif_transpose(src))
        img.thumbnail((size, size))
        return img
    except Exception:
        return None
