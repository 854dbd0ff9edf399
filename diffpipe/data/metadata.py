"""Metadata tables: ``metadata.csv|json|jsonl|parquet`` with a file and a caption column.

Paths in the file column are relative to the folder of the metadata file
(the Hugging Face ``imagefolder`` layout: ``metadata.jsonl`` with
``file_name``, one per split folder or one at the root). Column names
are configurable and otherwise auto-detected. Parsing never raises: a bad
file or a missing column comes back as a ``bad_metadata`` problem, a row whose
path leaves the root as ``path_outside_root``.
"""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Metadata file names read in any folder when the config names no metadata file.
DEFAULT_NAMES = ("metadata.jsonl", "metadata.csv", "metadata.json", "metadata.parquet")
FILE_COLUMNS = (
    "file_name",
    "filename",
    "file",
    "path",
    "filepath",
    "file_path",
    "image",
    "video",
    "media",
)
CAPTION_COLUMNS = ("caption", "captions", "text", "prompt", "prompts", "tags", "description")
FORMATS = {".csv": "csv", ".json": "json", ".jsonl": "jsonl", ".parquet": "parquet"}


@dataclass(frozen=True)
class Problem:
    reason: str
    where: str  # file path or "metadata.csv row 12"
    note: str
    path: str | None = None  # the media path a row names, when there is one


@dataclass
class MetadataTable:
    """Rows of a dataset's metadata files: relative media path -> raw caption cell."""

    files: list[str] = field(default_factory=list)  # metadata files read, relative to the root
    captions: dict[str, Any] = field(default_factory=dict)
    where: dict[str, str] = field(default_factory=dict)  # media path -> "metadata.jsonl row 3"
    #: Per auxiliary role (``mask``, ``control``): media path -> the aux file's relative path
    #: (None for an empty cell).
    aux: dict[str, dict[str, str | None]] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)


def parse_records(data: bytes, fmt: str) -> list[dict[str, Any]]:
    """Records of a metadata file's content; ValueError with a human reason on bad input."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(io.BytesIO(data)).to_pylist()
        except Exception as err:
            raise ValueError(f"not a readable Parquet file ({err})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ValueError(f"not valid UTF-8 (byte offset {err.start})") from None
    if fmt == "csv":
        try:
            return list(csv.DictReader(io.StringIO(text, newline="")))
        except csv.Error as err:
            raise ValueError(f"not valid CSV ({err})") from None
    if fmt == "jsonl":
        records = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"line {n} is not valid JSON ({err.msg})") from None
    else:
        try:
            records = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"not valid JSON ({err.msg} at line {err.lineno})") from None
        if isinstance(records, dict):  # {"file": caption, ...} or {"data": [...]}
            lists = [v for v in records.values() if isinstance(v, list) and all(isinstance(x, dict) for x in v)]
            if len(records) == 1 and lists:
                records = lists[0]
            else:
                raise ValueError("a JSON metadata file must hold a list of records")
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ValueError("every record must be an object with named fields")
    return records


def pick_column(columns: list[str], configured: str | None, candidates: tuple[str, ...]) -> str | None:
    """The configured column if present, else the first candidate (case-insensitive)."""
    if configured:
        return configured if configured in columns else None
    lower = {c.lower(): c for c in columns}
    return next((lower[c] for c in candidates if c in lower), None)


def relative_path(root: Path, value: str) -> str | None:
    """The POSIX path of ``value`` relative to ``root``, or None when it leaves the root."""
    value = value.replace("\\", "/")
    if os.path.isabs(value):
        try:
            value = str(Path(value).relative_to(root))
        except ValueError:
            return None
    rel = os.path.normpath(value).replace(os.sep, "/")
    if rel == "." or rel == ".." or rel.startswith("../"):
        return None
    return rel


def read_metadata(
    root: Path,
    files: list[str],
    file_column: str | None,
    caption_column: str | None,
    aux_columns: dict[str, str] | None = None,
) -> MetadataTable:
    """Parse a dataset's metadata files (paths relative to ``root``) into one table.

    A file's paths are relative to the folder holding it (``test/metadata.jsonl``
    names files in ``test/``, as in the ``imagefolder`` layout). ``aux_columns``
    (role -> column, e.g. ``{"mask": "mask_file"}``) name columns of per-item
    auxiliary image paths, relative like the file column.
    """
    table = MetadataTable(list(files))
    table.aux = {role: {} for role in aux_columns or {}}
    for rel in files:
        _read_one(root, rel, file_column, caption_column, table, aux_columns or {})
    return table


def _inside(root: Path, real_root: Path, base: str, value: str) -> str | None:
    """``value`` (relative to the metadata folder ``base``) relative to ``root``; None outside it."""
    joined = value if os.path.isabs(value) or not base else f"{base}/{value}"
    rel = relative_path(root, joined)
    if rel is not None:
        try:  # a path inside the root can still leave it through a symlink
            (root / rel).resolve().relative_to(real_root)
        except (ValueError, OSError, RuntimeError):
            rel = None
    return rel


def _read_one(
    root: Path,
    meta_rel: str,
    file_column: str | None,
    caption_column: str | None,
    table: MetadataTable,
    aux_columns: dict[str, str],
) -> None:
    path = root / meta_rel
    name = meta_rel
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        msg = f"{name}: unknown metadata format; use one of {sorted(FORMATS)}"
        table.problems.append(Problem("bad_metadata", str(path), msg))
        return
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        table.problems.append(Problem("bad_metadata", str(path), f"metadata file {name} does not exist"))
        return
    except OSError as err:
        msg = f"cannot read metadata file {name}: {err.strerror}"
        table.problems.append(Problem("unreadable", str(path), msg))
        return
    try:
        records = parse_records(data, fmt)
    except ValueError as err:
        table.problems.append(Problem("bad_metadata", str(path), f"metadata file {name}: {err}"))
        return
    columns = list(dict.fromkeys(k for r in records for k in r))
    fcol = pick_column(columns, file_column, FILE_COLUMNS)
    ccol = pick_column(columns, caption_column, CAPTION_COLUMNS)
    for col, configured_name, kind, cands in (
        (fcol, file_column, "file", FILE_COLUMNS),
        (ccol, caption_column, "caption", CAPTION_COLUMNS),
    ):
        if col is None:
            wanted = repr(configured_name) if configured_name else f"one of {', '.join(cands)}"
            have = ", ".join(columns) or "none"
            msg = f"metadata file {name} has no {kind} column {wanted} (columns: {have}); set datasets[].{kind}_column"
            table.problems.append(Problem("bad_metadata", str(path), msg))
    for role, col in aux_columns.items():
        if col not in columns:
            have = ", ".join(columns) or "none"
            msg = f"metadata file {name} has no {role} column {col!r} (columns: {have}); fix datasets[].{role}_column"
            table.problems.append(Problem("bad_metadata", str(path), msg))
    if fcol is None or ccol is None:
        return
    real_root = root.resolve()
    base = os.path.dirname(meta_rel)
    for n, rec in enumerate(records, 1):
        where = f"{name} row {n}"
        value = rec.get(fcol)
        if not isinstance(value, str) or not value.strip():
            table.problems.append(Problem("bad_metadata", str(path), f"{where}: {fcol!r} is empty or not text"))
            continue
        value = value.strip()
        rel = _inside(root, real_root, base, value)
        if rel is None:
            msg = f"{where}: {value!r} is outside the dataset folder {root}"
            table.problems.append(Problem("path_outside_root", str(path), msg))
            continue
        if rel in table.captions:
            msg = f"{where}: {rel!r} is already listed in {table.where[rel]}"
            table.problems.append(Problem("bad_metadata", str(path), msg))
            continue
        table.captions[rel] = rec.get(ccol)
        table.where[rel] = where
        for role, col in aux_columns.items():
            cell = rec.get(col)
            aux_rel = None
            if isinstance(cell, str) and cell.strip():
                aux_rel = _inside(root, real_root, base, cell.strip())
                if aux_rel is None:
                    msg = f"{where}: {role} {cell.strip()!r} is outside the dataset folder {root}"
                    table.problems.append(Problem("path_outside_root", str(path), msg))
            table.aux[role][rel] = aux_rel
