"""Declared image sizes, read from file headers without decoding a pixel.

A decoder allocates what the header declares, so a file of a few bytes can
cost gigabytes (a 35-byte GIF declares a 16000x16000 screen, and FFmpeg fills
every frame at the screen's size). :func:`declared_size` reads only the
header fields that set that size, so validation and the cache jobs can
refuse a file before any decoder sees it.

GIF: the screen and every frame's extent (left + width, top + height) count,
walking the blocks without decompressing them: Pillow grows its canvas to
hold a frame placed outside the screen, FFmpeg allocates the screen. TIFF:
the largest page. WebP: the canvas (animation frames must fit in it).
Pure standard library; never raises on bad input (None: unknown or cut short).
"""

from __future__ import annotations

import struct
from typing import BinaryIO

#: Start-of-frame markers of every JPEG coding process (not DHT, JPG or DAC).
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
#: TIFF IFDs read at most (a loop of offsets or a huge page chain ends the walk).
_MAX_PAGES = 1024


class _Short(Exception):
    """The file ends inside a header field."""


def _read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) < n:
        raise _Short
    return data


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


def declared_size(f: BinaryIO) -> tuple[str, int, int] | None:
    """``(format, width, height)`` a decoder would allocate, from the header of a seekable file.

    For the image formats :func:`sniff` knows (``png``, ``jpeg``, ``gif``,
    ``webp``, ``tiff``, ``bmp``); None for other content or a header cut
    short. The position of ``f`` is restored.
    """
    pos = f.tell()
    try:
        f.seek(0)
        fmt = sniff(f.read(32))
        if fmt not in _READERS:
            return None
        f.seek(0)
        return (fmt, *_READERS[fmt](f))
    except (_Short, struct.error, ValueError):
        return None
    finally:
        f.seek(pos)


def _png(f: BinaryIO) -> tuple[int, int]:
    chunk = _read(f, 24)  # signature, IHDR length and type, width, height
    if chunk[12:16] != b"IHDR":
        raise ValueError("no IHDR")
    return struct.unpack(">II", chunk[16:24])


def _gif(f: BinaryIO) -> tuple[int, int]:
    w, h, flags = struct.unpack("<HHB", _read(f, 13)[6:11])
    if flags & 0x80:  # global color table
        f.seek(3 << ((flags & 7) + 1), 1)
    try:
        while (block := f.read(1)) and block != b";":
            if block == b",":  # image descriptor: a frame
                left, top, fw, fh, flags = struct.unpack("<HHHHB", _read(f, 9))
                w, h = max(w, left + fw), max(h, top + fh)
                if flags & 0x80:  # local color table
                    f.seek(3 << ((flags & 7) + 1), 1)
                _read(f, 1)  # LZW minimum code size
            elif block == b"!":  # extension: label, then sub-blocks
                _read(f, 1)
            else:
                break  # not a block: decoders stop here too
            while n := _read(f, 1)[0]:  # data sub-blocks, skipped unread
                f.seek(n, 1)
    except _Short:
        pass  # a cut file still declares what came before the cut
    return w, h


def _jpeg(f: BinaryIO) -> tuple[int, int]:
    f.seek(2)
    while True:
        if _read(f, 1) != b"\xff":
            raise ValueError("not a marker")
        marker = _read(f, 1)[0]
        while marker == 0xFF:  # fill bytes
            marker = _read(f, 1)[0]
        if marker in (0x01, *range(0xD0, 0xD8)):  # no length field
            continue
        if marker in (0xD9, 0xDA):  # end of image or start of scan before any frame header
            raise ValueError("no frame header")
        (length,) = struct.unpack(">H", _read(f, 2))
        if marker in _SOF:
            h, w = struct.unpack(">xHH", _read(f, 5))
            return w, h
        f.seek(length - 2, 1)


def _webp(f: BinaryIO) -> tuple[int, int]:
    chunk = _read(f, 30)
    kind, body = chunk[12:16], chunk[20:]
    if kind == b"VP8X":  # extended: the canvas, 24-bit sizes minus one
        return 1 + int.from_bytes(body[4:7], "little"), 1 + int.from_bytes(body[7:10], "little")
    if kind == b"VP8L" and body[0] == 0x2F:  # lossless: 14-bit sizes minus one
        bits = int.from_bytes(body[1:5], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if kind == b"VP8 " and body[3:6] == b"\x9d\x01\x2a":  # lossy key frame
        w, h = struct.unpack("<HH", body[6:10])
        return w & 0x3FFF, h & 0x3FFF
    raise ValueError("unknown WebP chunk")


def _tiff(f: BinaryIO) -> tuple[int, int]:
    order = "<" if _read(f, 4)[:2] == b"II" else ">"
    (offset,) = struct.unpack(order + "I", _read(f, 4))
    pages: list[tuple[int, int]] = []
    seen: set[int] = set()
    try:
        while offset and offset not in seen and len(seen) < _MAX_PAGES:
            seen.add(offset)
            f.seek(offset)
            (count,) = struct.unpack(order + "H", _read(f, 2))
            size = {}
            for _ in range(count):
                tag, typ, _n, value = struct.unpack(order + "HHI4s", _read(f, 12))
                if tag in (256, 257):  # ImageWidth, ImageLength: SHORT or LONG
                    size[tag] = struct.unpack(order + ("H" if typ == 3 else "I"), value[: 2 if typ == 3 else 4])[0]
            pages.append((size.get(256, 0), size.get(257, 0)))
            (offset,) = struct.unpack(order + "I", _read(f, 4))
    except _Short:
        if not pages:
            raise
    return max(pages, key=lambda s: s[0] * s[1])


def _bmp(f: BinaryIO) -> tuple[int, int]:
    head = _read(f, 26)
    if struct.unpack("<I", head[14:18])[0] == 12:  # OS/2 core header: 16-bit sizes
        return struct.unpack("<HH", head[18:22])
    w, h = struct.unpack("<ii", head[18:26])
    return abs(w), abs(h)  # a negative height means rows stored top-down


_READERS = {"png": _png, "jpeg": _jpeg, "gif": _gif, "webp": _webp, "tiff": _tiff, "bmp": _bmp}
