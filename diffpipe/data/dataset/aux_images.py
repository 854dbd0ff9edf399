"""Per-item auxiliary images in validation: loss masks and control (conditioning) images.

A dataset names them with a parallel folder (``mask_path``, ``control_path``:
the same relative stem as the media file, any image extension) or with a
metadata column (``mask_column``, ``control_column``: a path relative to the
metadata file's folder). Validation finds each item's file, hashes and decodes
it like a media file (reusing the previous manifest's result while its size
and mtime are unchanged) and flags ``missing_<role>``, ``corrupt_<role>`` and
``<role>_size_mismatch``; the policy decides what each does to the item. The
file's sha256 lands in the manifest row (``<role>_sha256``) and from there in
the item's latent cache key, so editing a mask re-caches that item only.
Nothing is ever written next to the user's files.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from diffpipe.config import CONTROL_ROLES, DatasetConfig
from diffpipe.data.dataset.checks import add_reason
from diffpipe.data.dataset.discover import Listing
from diffpipe.data.dataset.metadata import MetadataTable

#: ``control2``.. are an item's further reference images (``control_path`` as a list); their problems
#: are the control's (``missing_control``, ...): an item's references are used all together or not at all.
ROLES = ("mask", *CONTROL_ROLES)
#: Manifest columns per role: ``mask_path``, ``mask_sha256``, ...
COLUMNS = ("path", "sha256", "size", "mtime_ns", "width", "height")
#: Probe problems that make an aux image unusable (``extension_mismatch`` does not).
_UNUSABLE = {"unreadable", "zero_byte", "corrupt_media", "decompression_bomb", "no_frames"}
#: Aspect ratios of an aux image and its media file may differ by this much (log ratio).
ASPECT_TOLERANCE = 0.02

Issue = Callable[[str, str, str], None]


def reason_role(role: str) -> str:
    """The role a reason names: ``control`` for every reference image, else the role itself."""
    return "control" if role in CONTROL_ROLES else role


def problem_reasons(role: str) -> set[str]:
    """The reasons that make a role's image unusable for its item (the plan then ignores it)."""
    role = reason_role(role)
    return {f"missing_{role}", f"corrupt_{role}", f"{role}_size_mismatch"}


def _label(role: str) -> str:
    """A role in messages: ``control``, ``reference 2``, ..."""
    return f"reference {CONTROL_ROLES.index(role) + 1}" if role in CONTROL_ROLES[1:] else role


def referenced_files(meta: MetadataTable) -> set[str]:
    """Paths (relative to the dataset root) that metadata aux columns name: not media items."""
    return {rel for files in meta.aux.values() for rel in files.values() if rel} - set(meta.captions)


def _stat(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def resolve(ds: DatasetConfig, listing: Listing, meta: MetadataTable, rows: list[dict[str, Any]], issue: Issue) -> None:
    """Set every row's aux columns to None, then each role's ``<role>_path`` or a ``missing_<role>``."""
    for row in rows:
        row.update({f"{role}_{col}": None for role in ROLES for col in COLUMNS})
    for role in ds.aux_roles():
        folder, _, key = ds.aux_source(role)
        if folder and role not in listing.aux_roots:
            issue(
                str(Path(folder).absolute()),
                "missing_dataset",
                f"datasets[{ds.name}].{key}: folder {Path(folder).absolute()} does not exist",
            )
            continue
        for row in rows:
            path, note = _find(ds, role, listing, meta, row["relpath"])
            if path is None:
                add_reason(row, f"missing_{reason_role(role)}", note)
            else:
                row[f"{role}_path"] = path


def _find(ds: DatasetConfig, role: str, listing: Listing, meta: MetadataTable, rel: str) -> tuple[str | None, str]:
    """The absolute path of ``rel``'s aux image, or None and a sentence naming what is missing."""
    stem = os.path.splitext(rel)[0]
    folder, column, key = ds.aux_source(role)
    label = _label(role)
    if folder:
        found = listing.aux[role].get(stem)
        if found:
            return found, ""
        folder = listing.aux_roots[role]
        return None, f"no {label} image {folder / stem}.* (datasets[{ds.name}].{key})"
    if rel not in meta.where:
        return None, f"no metadata row names this file, so it has no {label} column {column!r}"
    aux_rel = meta.aux[role].get(rel)
    if aux_rel is None:
        return None, f"{meta.where[rel]}: the {label} column {column!r} is empty"
    path = str(listing.root / aux_rel)
    if not os.path.isfile(path):
        return None, f"{meta.where[rel]}: {label} image {path} does not exist"
    return path, ""


def reuse_or_probe(
    rows: list[dict[str, Any]],
    listing: Listing,
    previous: dict[str, dict[str, Any]],
    reuse_probe: bool,
) -> list[tuple[dict[str, Any], str, str]]:
    """Fill hash and size from the previous manifest where the file is unchanged; the rest to probe."""
    jobs: list[tuple[dict[str, Any], str, str]] = []
    for row in rows:
        for role in ROLES:
            path = row[f"{role}_path"]
            if path is None:
                continue
            rel = os.path.relpath(path, listing.root)
            size, mtime = listing.stats.get(path) or listing.stats.get(rel) or _stat(path) or (0, 0)
            row[f"{role}_size"], row[f"{role}_mtime_ns"] = size, mtime
            prev = previous.get(row["id"])
            if (
                reuse_probe
                and prev
                and prev.get(f"{role}_path") == path
                and prev.get(f"{role}_sha256")
                and prev[f"{role}_size"] == size
                and prev[f"{role}_mtime_ns"] == mtime
            ):
                for col in ("sha256", "width", "height"):
                    row[f"{role}_{col}"] = prev[f"{role}_{col}"]
                for reason, note in zip(prev["reasons"], prev["notes"], strict=True):
                    if reason == f"corrupt_{reason_role(role)}" and f"{_label(role)} image {path}:" in note:
                        add_reason(row, reason, note)
            else:
                jobs.append((row, role, path))
    return jobs


def apply_probe(row: dict[str, Any], role: str, probe: dict[str, Any]) -> None:
    """Record a probed aux image on its item's row; an unusable one is ``corrupt_<role>``."""
    path = row[f"{role}_path"]
    row[f"{role}_sha256"] = probe["sha256"]
    row[f"{role}_width"], row[f"{role}_height"] = probe["width"], probe["height"]
    problems = [note for reason, note in probe["problems"] if reason in _UNUSABLE]
    if probe["kind"] == "video" and not problems:
        problems.append("it is a video; a mask or control must be one image")
    if problems:
        row[f"{role}_width"] = row[f"{role}_height"] = None
        add_reason(row, f"corrupt_{reason_role(role)}", f"{_label(role)} image {path}: {'; '.join(problems)}")


def check_geometry(row: dict[str, Any]) -> None:
    """Flag ``<role>_size_mismatch`` when an aux image would not line up with its media file.

    The aux image is resized and cropped exactly like its target, so only the
    aspect ratio must agree (a half-resolution mask is fine).
    """
    w, h = row["width"], row["height"]
    for role in ROLES:
        aw, ah = row[f"{role}_width"], row[f"{role}_height"]
        if not (w and h and aw and ah):
            continue
        if abs(math.log((aw / ah) / (w / h))) > ASPECT_TOLERANCE:
            add_reason(
                row,
                f"{reason_role(role)}_size_mismatch",
                f"{_label(role)} image {row[f'{role}_path']} is {aw}x{ah} (aspect {aw / ah:.3g}), the "
                f"{row['kind']} is {w}x{h} (aspect {w / h:.3g}); they must have the same aspect ratio",
            )
