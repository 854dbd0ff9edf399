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
import unicodedata
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


_JSON_TYPES = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


def _json_type(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


@dataclass
class Records:
    """A metadata file's rows: ``rows[n - 1]`` is row n, None where row n is malformed
    (``problems`` says why, as ``(row, sentence)``); ``columns`` in file order."""

    rows: list[dict[str, Any] | None]
    columns: list[str]
    problems: list[tuple[int, str]] = field(default_factory=list)


def read_records(data: bytes, fmt: str) -> Records:
    """Rows of a metadata file's content, each malformed row named with its problem.

    Raises:
        ValueError: with a human reason, when the whole file is unusable (not
            UTF-8, not JSON, not a list of records, not Parquet).
    """
    if fmt == "parquet":
        # Deferred for start-up time: Snakemake imports this module (via discover) to build its DAG.
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(io.BytesIO(data))
            return Records(table.to_pylist(), table.column_names)
        except Exception as err:
            raise ValueError(f"not a readable Parquet file ({err})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ValueError(f"not valid UTF-8 (line {line}, byte offset {err.start}); re-save it as UTF-8") from None
    if fmt == "csv":
        return _csv(text)
    if fmt == "jsonl":
        return _jsonl(text)
    try:
        records = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON ({err.msg} at line {err.lineno})") from None
    except RecursionError:
        raise ValueError("nested too deeply to read as JSON") from None
    if isinstance(records, dict):  # {"data": [...]}
        lists = [v for v in records.values() if isinstance(v, list)]
        if len(records) != 1 or not lists:
            raise ValueError("a JSON metadata file must hold a list of records")
        records = lists[0]
    if not isinstance(records, list):
        raise ValueError(f"a JSON metadata file must hold a list of records, not {_json_type(records)}")
    return _objects([(f"record {n}", rec) for n, rec in enumerate(records, 1)])


class _Unparsed(str):
    """Why a JSON Lines line could not be parsed (a sentence that follows its label)."""


def _objects(values: list[tuple[str, Any]]) -> Records:
    """Rows from parsed JSON values ``(label, value)``: one that is not an object is its row's problem."""
    out = Records([], [])
    for n, (label, value) in enumerate(values, 1):
        if isinstance(value, _Unparsed):
            out.problems.append((n, f"{label} {value}"))
            value = None
        elif not isinstance(value, dict):
            out.problems.append((n, f"{label} is {_json_type(value)}, not an object with named fields"))
            value = None
        out.rows.append(value)
    out.columns = list(dict.fromkeys(k for r in out.rows if r for k in r))
    return out


def _csv(text: str) -> Records:
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader, [])
        out = Records([], header)
        for row in reader:
            if not row:  # a blank line is no row
                continue
            n = len(out.rows) + 1
            if len(row) != len(header):
                fields = f"{len(row)} field{'s' * (len(row) != 1)}"
                out.problems.append(
                    (
                        n,
                        f"row {n} (line {reader.line_num}) has {fields}, the header has {len(header)}; "
                        'quote a value holding a comma ("a cat, on a mat")',
                    )
                )
                out.rows.append(None)
            else:
                out.rows.append(dict(zip(header, row, strict=True)))
    except csv.Error as err:
        raise ValueError(f"not valid CSV (line {reader.line_num}: {err})") from None
    return out


def _jsonl(text: str) -> Records:
    return _objects([(f"line {n}", _json_line(line)) for n, line in enumerate(text.splitlines(), 1) if line.strip()])


def _json_line(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        return _Unparsed(f"is not valid JSON ({err.msg})")
    except RecursionError:
        return _Unparsed("is nested too deeply to read as JSON")


def parse_records(data: bytes, fmt: str) -> list[dict[str, Any]]:
    """Records of a metadata file's content; ValueError with a human reason on any bad row or file."""
    records = read_records(data, fmt)
    if records.problems:
        raise ValueError(records.problems[0][1])
    return [r for r in records.rows if r is not None]


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
    *,
    link_root: Path | None = None,
) -> MetadataTable:
    """Parse a dataset's metadata files (paths relative to ``root``) into one table.

    A file's paths are relative to the folder holding it (``test/metadata.jsonl``
    names files in ``test/``, as in the ``imagefolder`` layout). ``aux_columns``
    (role -> column, e.g. ``{"mask": "mask_file"}``) name columns of per-item
    auxiliary image paths, relative like the file column. ``link_root``: where
    symbolic links may lead (default ``root``; a hub snapshot's links lead into
    its repository's ``blobs`` folder).
    """
    table = MetadataTable(list(files))
    table.aux = {role: {} for role in aux_columns or {}}
    for rel in files:
        try:
            _read_one(root, rel, file_column, caption_column, table, aux_columns or {}, link_root or root)
        except Exception as err:  # a case not foreseen above still names the file, never a traceback
            msg = f"metadata file {rel} cannot be read: {type(err).__name__}: {err}"
            table.problems.append(Problem("bad_metadata", str(root / rel), msg))
    return table


def _unusable(value: str) -> bool:
    """A control character (NUL, newline...) or a lone surrogate: no file name in a dataset holds one."""
    return any(unicodedata.category(c) in ("Cc", "Cs") for c in value)


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
    link_root: Path,
) -> None:
    path = root / meta_rel
    records = _load_records(path, meta_rel, table)
    if records is None:
        return
    fcol, ccol = _check_columns(records, path, meta_rel, file_column, caption_column, aux_columns, table)
    if fcol is None or ccol is None:
        return
    real_root = link_root.resolve()
    base = os.path.dirname(meta_rel)
    for n, rec in enumerate(records.rows, 1):
        if rec is None:  # malformed: reported above
            continue
        where = f"{meta_rel} row {n}"
        rel = _row_path(rec.get(fcol), fcol, where, root, real_root, base, path, table)
        if rel is None:
            continue
        table.captions[rel] = rec.get(ccol)
        table.where[rel] = where
        for role, col in aux_columns.items():
            table.aux[role][rel] = _aux_path(rec.get(col), role, where, root, real_root, base, path, table)


def _load_records(path: Path, name: str, table: MetadataTable) -> Records | None:
    """The parsed rows of one metadata file (None: it cannot be read, a problem says why); the malformed
    rows' notes become problems."""
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        msg = f"{name}: unknown metadata format; use one of {sorted(FORMATS)}"
        table.problems.append(Problem("bad_metadata", str(path), msg))
        return None
    try:
        if path.exists() and not path.is_file():  # a folder, or a pipe that would block the read
            msg = f"metadata file {name} is not a regular file"
            table.problems.append(Problem("bad_metadata", str(path), msg))
            return None
        data = path.read_bytes()
    except FileNotFoundError:
        table.problems.append(Problem("bad_metadata", str(path), f"metadata file {name} does not exist"))
        return None
    except OSError as err:
        msg = f"cannot read metadata file {name}: {err.strerror}"
        table.problems.append(Problem("unreadable", str(path), msg))
        return None
    if not data.strip():
        table.problems.append(Problem("bad_metadata", str(path), f"metadata file {name} is empty"))
        return None
    try:
        records = read_records(data, fmt)
    except ValueError as err:
        table.problems.append(Problem("bad_metadata", str(path), f"metadata file {name}: {err}"))
        return None
    for _, note in records.problems:
        table.problems.append(Problem("bad_metadata", str(path), f"metadata file {name}: {note}"))
    return records


def _check_columns(
    records: Records,
    path: Path,
    name: str,
    file_column: str | None,
    caption_column: str | None,
    aux_columns: dict[str, str],
    table: MetadataTable,
) -> tuple[str | None, str | None]:
    """The file and caption columns (configured or detected; None: missing, a problem says so), and a problem
    for each configured aux column the file lacks."""
    columns = [str(c) for c in records.columns]
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
    return fcol, ccol


def _row_path(
    value: Any, fcol: str, where: str, root: Path, real_root: Path, base: str, path: Path, table: MetadataTable
) -> str | None:
    """A row's media path relative to the root (None: empty, unusable, outside the root or listed already: a
    problem says which)."""
    if not isinstance(value, str) or not value.strip():
        table.problems.append(Problem("bad_metadata", str(path), f"{where}: {fcol!r} is empty or not text"))
        return None
    if _unusable(value):
        msg = f"{where}: {value!r} holds a control character or an invalid code point; no file has that name"
        table.problems.append(Problem("bad_metadata", str(path), msg))
        return None
    value = value.strip()
    rel = _inside(root, real_root, base, value)
    if rel is None:
        msg = f"{where}: {value!r} is outside the dataset folder {root}"
        table.problems.append(Problem("path_outside_root", str(path), msg))
        return None
    if rel in table.captions:
        msg = f"{where}: {rel!r} is already listed in {table.where[rel]}"
        table.problems.append(Problem("bad_metadata", str(path), msg))
        return None
    return rel


def _aux_path(
    cell: Any, role: str, where: str, root: Path, real_root: Path, base: str, path: Path, table: MetadataTable
) -> str | None:
    """A row's aux file (mask, control) relative to the root (None: an empty cell, or a problem)."""
    if isinstance(cell, str) and _unusable(cell):
        msg = f"{where}: {role} {cell!r} holds a control character or an invalid code point"
        table.problems.append(Problem("bad_metadata", str(path), msg))
    elif isinstance(cell, str) and cell.strip():
        aux_rel = _inside(root, real_root, base, cell.strip())
        if aux_rel is None:
            msg = f"{where}: {role} {cell.strip()!r} is outside the dataset folder {root}"
            table.problems.append(Problem("path_outside_root", str(path), msg))
        return aux_rel
    return None
