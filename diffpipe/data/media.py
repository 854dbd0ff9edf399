"""Media probing: hash, identify and decode one file, the same way every stage sees it.

:func:`probe` is what validation's worker processes run per file: it reads
the bytes once (SHA-256), sniffs the real format from the magic bytes,
reads the image header (size, decompression-bomb check) and then fully
decodes, because truncation only shows on a full decode. Videos are decoded
frame by frame with PyAV: the frame count and fps are measured, never taken
from container metadata. :func:`to_rgb` is the one conversion to 8-bit RGB
(also used by the caches through ``buckets``).

Only Pillow and numpy are imported at module level (PyAV when a video is
decoded), so the validate command starts fast.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

_INT_MODES = {"I", "I;16", "I;16L", "I;16B", "I;16N"}
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


def sniff(head: bytes) -> str | None:
    """The format family from a file's first bytes, None when unknown."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "avi"
    if head[:2] == b"BM":
        return "bmp"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "tiff"
    if head[4:8] == b"ftyp":
        return "mp4"
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return "matroska"
    return None


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


def _read(path: str, size_hint: int) -> tuple[bytes | None, str]:
    """(content or None when large, sha256)."""
    if size_hint <= _IN_MEMORY:
        with open(path, "rb") as f:
            data = f.read()
        return data, hashlib.sha256(data).hexdigest()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return None, h.hexdigest()


def _probe_image(src: Any, p: Probe, max_pixels: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            img = Image.open(src)
        except Image.DecompressionBombError as err:
            p.problems.append(("decompression_bomb", f"{err}; not decoded"))
            return
        with img:
            w, h = img.size
            if w * h > max_pixels:
                p.width, p.height = w, h
                p.problems.append(
                    (
                        "decompression_bomb",
                        f"image is {w}x{h} = {w * h:,} pixels, over validation.max_pixels="
                        f"{max_pixels:,}; not decoded",
                    )
                )
                return
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


def _probe_video(src: Any, p: Probe) -> None:
    import av

    n, first, last = 0, None, None
    with av.open(src) as container:
        stream = next((s for s in container.streams if s.type == "video"), None)
        if stream is None:
            raise ValueError("the file holds no video stream")
        try:
            for frame in container.decode(stream):
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
    try:
        size = os.stat(path).st_size
        data, p.sha256 = _read(path, size)
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
    expected = EXT_FORMAT.get(os.path.splitext(path)[1].lower())
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
            _probe_video(src, p)
        else:
            _probe_image(src, p, max_pixels)
    except Exception as err:  # PIL: OSError, SyntaxError, ValueError...; PyAV: FFmpegError
        what = "video" if kind == "video" else "image"
        p.problems.append(("corrupt_media", f"cannot decode the {what}: {_reason(err)}"))
        p.width = p.height = p.frames = p.fps = None
    return p


def probe_many(jobs: list[tuple[str, str]], max_pixels: int) -> list[dict[str, Any]]:
    """Worker entry point: probe a chunk of ``(path, ext_kind)``."""
    return [probe(path, kind, max_pixels).as_dict() for path, kind in jobs]


def thumbnail(path: str, kind: str | None, size: int) -> Image.Image | None:
    """An RGB thumbnail (the first frame of a video), None when it cannot be decoded."""
    try:
        if kind == "video":
            import av

            with av.open(path) as container:
                frame = next(container.decode(video=0))
                img = frame.to_image()
        else:
            with Image.open(path) as src:
                if src.width * src.height > 64_000_000:  # never decode a bomb for a thumbnail
                    return None
                src.draft("RGB", (size, size))
                src.load()
                img = ImageOps.exif_transpose(src)
                img = to_rgb(img)
        img.thumbnail((size, size))
        return img
    except Exception:
        return None
