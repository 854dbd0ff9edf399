"""Caption decoding: bytes or metadata values -> a list of alternative captions.

Pure functions (property-tested). A caption file's non-empty lines are
alternatives (or one caption when ``caption_lines="join"``); a metadata cell
may hold a string or a list of strings. Tag-style captions are normalised.
Problems come back as a reason code and a sentence, never as an exception.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Literal

LineMode = Literal["alternatives", "join"]
Style = Literal["text", "tags"]


@dataclass(frozen=True)
class Captions:
    """Alternative captions of one item, or the reason there are none."""

    texts: tuple[str, ...] = ()
    reason: str | None = None
    note: str | None = None


def normalize_tags(text: str) -> str:
    """``" cat,  dog,,cat "`` -> ``"cat, dog"``: trimmed, empty and repeated tags dropped."""
    seen: dict[str, None] = {}
    for tag in text.split(","):
        tag = " ".join(tag.split())
        if tag:
            seen.setdefault(tag, None)
    return ", ".join(seen)


def _finish(texts: list[str], style: Style, where: str) -> Captions:
    if style == "tags":
        texts = [normalize_tags(t) for t in texts]
    texts = [t for t in texts if t]
    if not texts:
        return Captions(reason="empty_caption", note=f"{where} is empty or only whitespace")
    return Captions(tuple(texts))


def split_text(text: str, lines: LineMode = "alternatives", style: Style = "text") -> list[str]:
    """Alternatives of one caption text (no validation)."""
    text = text.removeprefix("\ufeff")  # editors write a BOM
    parts = [" ".join(line.split()) for line in text.splitlines()]
    parts = [p for p in parts if p]
    if lines == "join" and parts:
        parts = [" ".join(parts)]
    if style == "tags":
        parts = [t for t in (normalize_tags(p) for p in parts) if t]
    return parts


def decode_caption(
    data: bytes,
    *,
    name: str = "caption file",
    lines: LineMode = "alternatives",
    style: Style = "text",
) -> Captions:
    """Decode a caption file's bytes (UTF-8, optional BOM)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        return Captions(
            reason="caption_not_utf8",
            note=f"{name} is not valid UTF-8 (byte offset {err.start}: {data[err.start : err.start + 1]!r}); "
            "re-save it as UTF-8",
        )
    return _finish(split_text(text, lines, style), "text", name)


def from_metadata(
    value: Any, *, where: str, lines: LineMode = "alternatives", style: Style = "text"
) -> Captions:
    """Captions from a metadata cell: a string, a list of strings, or null."""
    if value is None or (isinstance(value, float) and value != value):  # null / NaN
        return Captions(reason="missing_caption", note=f"{where} has no caption")
    if isinstance(value, bytes):
        return decode_caption(value, name=where, lines=lines, style=style)
    if isinstance(value, str):
        return _finish(split_text(value, lines, style), "text", where)
    if isinstance(value, list | tuple):
        texts: list[str] = []
        for v in value:
            if isinstance(v, str):
                texts += split_text(v, "join", style)
        return _finish(texts, "text", where)
    return Captions(
        reason="empty_caption", note=f"{where}: caption is a {type(value).__name__}, not text"
    )


def caption_hash(texts: list[str] | tuple[str, ...]) -> str | None:
    """SHA-256 of the alternatives (newline-joined), None without a caption."""
    return hashlib.sha256("\n".join(texts).encode()).hexdigest() if texts else None


def final_caption(prefix: str, caption: str) -> str:
    """What the model reads: the prefix (e.g. a trigger word), a space, the caption (as the plan does)."""
    prefix = prefix.strip()
    return f"{prefix} {caption}" if prefix else caption
