"""Checks over probed manifest rows, one row at a time: geometry, caption tokens, eval split.

Each function adds reason codes (and a sentence) to row dicts; the policy
(:mod:`diffpipe.policy`) decides later what a reason does to the row.
Token counts come from a :class:`TokenCounter`: the stages pass the model family's real tokenizers
(:class:`diffpipe.families.token_counter.FamilyTokenCounter`), loaded only when a caption needs counting.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any, Protocol

from diffpipe.config import DatasetConfig, ValidationConfig
from diffpipe.data.dataset import captions as cap
from diffpipe.data.dataset.metadata import relative_path
from diffpipe.utils import digest

#: Reasons found by reading media content: reused with the hash while the content is unchanged
#: (a file's size and mtime, a table row's bytes).
PROBE_REASONS = frozenset(
    {"zero_byte", "corrupt_media", "extension_mismatch", "decompression_bomb", "large_media", "no_frames"}
)


class TokenCounter(Protocol):
    """Counts caption tokens with a model's real tokenizers."""

    key: str  # changes when the tokenizers may change

    def limits(self) -> dict[str, int]: ...

    def count(self, texts: list[str]) -> dict[str, list[int]]: ...


def add_reason(row: dict[str, Any], reason: str, note: str) -> None:
    """Record a reason code and its sentence on a manifest row."""
    row["reasons"].append(reason)
    row["notes"].append(note)


def _smallest_bucket(ds: DatasetConfig) -> tuple[float, float]:
    """(width, height) of the narrowest and of the flattest bucket at the smallest resolution."""
    res = min(getattr(ds, "resolutions", None) or [ds.resolution])
    ratios = getattr(ds, "aspect_ratios", None)
    if ratios:
        lo, hi = min(ratios), max(ratios)
    elif getattr(ds, "ar_buckets", None):
        lo, hi = ds.min_ar, ds.max_ar
    else:
        lo, hi = 0.5, 2.0  # the classic buckets, 1:2 to 2:1
    return res * math.sqrt(lo), res / math.sqrt(hi)


def check_geometry(ds: DatasetConfig, vcfg: ValidationConfig, row: dict[str, Any]) -> None:
    """Flag ``too_small``, ``bad_aspect`` and ``too_few_frames`` on a decoded row."""
    w, h = row["width"], row["height"]
    if (
        not w
        or not h
        or "decompression_bomb" in row["reasons"]
        or "corrupt_media" in row["reasons"]
    ):
        return
    bw, bh = _smallest_bucket(ds)
    if min(w, h) < vcfg.min_size:
        add_reason(
            row,
            "too_small",
            f"{row['kind']} is {w}x{h}, a side is below validation.min_size={vcfg.min_size}",
        )
    elif w < bw and h < bh:
        add_reason(
            row,
            "too_small",
            f"{row['kind']} is {w}x{h}, below the smallest bucket (narrowest {bw:.0f} px "
            f"wide, flattest {bh:.0f} px high); it would be upscaled",
        )
    lo, hi = vcfg.aspect_range
    if not lo <= w / h <= hi:
        add_reason(
            row,
            "bad_aspect",
            f"aspect ratio {w}/{h} = {w / h:.3g} is outside validation.aspect_range=[{lo}, {hi}]",
        )
    frames = row["frames"]
    buckets = getattr(ds, "frame_buckets", None)
    need, where = vcfg.min_frames, f"validation.min_frames={vcfg.min_frames}"
    if buckets and min(buckets) > need:
        need, where = (
            min(buckets),
            f"the smallest of datasets[{ds.name}].frame_buckets ({min(buckets)})",
        )
    if row["kind"] == "video" and frames and frames < need:
        add_reason(
            row, "too_few_frames", f"the video has {frames} decodable frame(s), fewer than {where}"
        )


def check_tokens(
    rows: list[dict[str, Any]],
    prefixes: dict[str, str],
    counter: TokenCounter | None,
    previous: dict[str, dict[str, Any]],
) -> None:
    """Token counts per encoder (most over the alternatives), reused while captions are unchanged."""
    todo: list[dict[str, Any]] = []
    for row in rows:
        row["tokens"], row["tokens_key"] = [], None
        if counter is None or not row["captions"]:
            continue
        key = hashlib.sha256(
            "\0".join([counter.key, prefixes[row["dataset"]], *row["captions"]]).encode()
        ).hexdigest()[:16]
        row["tokens_key"] = key
        prev = previous.get(row["id"])
        if prev and prev["tokens_key"] == key:
            row["tokens"] = prev["tokens"]
        else:
            todo.append(row)
    if todo:
        limits = counter.limits()
        texts = sorted(
            {cap.final_caption(prefixes[r["dataset"]], t) for r in todo for t in r["captions"]}
        )
        counts = counter.count(texts)
        by_text = {enc: dict(zip(texts, n, strict=True)) for enc, n in counts.items()}
        for row in todo:
            finals = [cap.final_caption(prefixes[row["dataset"]], t) for t in row["captions"]]
            row["tokens"] = [
                {
                    "encoder": enc,
                    "tokens": max(by_text[enc][t] for t in finals),
                    "limit": limits[enc],
                }
                for enc in sorted(by_text)
            ]
    for row in rows:
        for t in row["tokens"]:
            if t["tokens"] > t["limit"]:
                n = len(row["captions"])
                which = "the longest of its {n} captions" if n > 1 else "the caption"
                add_reason(
                    row,
                    "caption_too_long",
                    f"{which.format(n=n)} has {t['tokens']} tokens for "
                    f"{t['encoder']}, over its limit of {t['limit']}; the rest would be cut off",
                )


def eval_files(ds: DatasetConfig, root: Path) -> set[str]:
    """The relative paths ``datasets[].eval_files`` names."""
    return {relative_path(root, f) or f for f in ds.eval_files}


def missing_eval_files(ds: DatasetConfig, wanted: set[str], present: set[str], issue: Any, root: Path) -> None:
    """A ``missing_file`` issue for each of ``wanted`` (:func:`eval_files`) that is not a media file."""
    for f in sorted(wanted - present):
        issue(
            str(root / f),
            "missing_file",
            f"datasets[{ds.name}].eval_files names {f!r}, which is not a media file of the dataset",
        )


def assign_split(ds: DatasetConfig, rows: list[dict[str, Any]], wanted: set[str]) -> None:
    """Set each row's ``split``: ``eval`` for `eval_files` (``wanted``) and the `eval_fraction` draw, else
    ``train``."""
    for row in rows:
        rel = row["relpath"]
        held = rel in wanted
        if not held and ds.eval_fraction > 0:
            # A table row draws by its content key (``_draw``): reordering rows keeps the split.
            held = int(digest([ds.eval_seed, row.get("_draw", rel)])[:15], 16) / 16**15 < ds.eval_fraction
        row["split"] = "eval" if held else "train"
