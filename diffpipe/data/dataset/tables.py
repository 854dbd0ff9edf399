"""Datasets stored as tables: a folder saved by the ``datasets`` library, or Parquet shards.

Each row is one item: its media are the bytes of a cell (the ``datasets``
``Image``/``Video`` struct ``{bytes, path}``, or a plain binary column), its
caption another column. A row's media has a *locator*, a string that stands
where a file path stands everywhere else (manifest ``path``, plan entries,
reports)::

    parquet:/abs/data/train-00000-of-00002.parquet#row=12&column=image
    arrow:/abs/saved/data-00000-of-00001.arrow#row=12&column=image

File paths in a manifest are absolute, so a locator (which starts with a
scheme) never reads as one. :func:`read_media` is the one reader of media
bytes, for files and cells alike: validation's probes, the cache jobs and
the report's thumbnails all go through it, so a cell is hashed, checked for
decompression bombs and decoded exactly like a file.

Layouts (:func:`find_tables`): ``state.json`` beside ``dataset_info.json`` (a
saved ``Dataset``: Arrow IPC stream files listed in it), ``dataset_dict.json`` (a saved ``DatasetDict``:
one such folder per split), else every ``*.parquet`` below the folder
(metadata files aside) whose split, read from the hub's names
(``data/train-00000-of-00002.parquet``, ``train/0000.parquet``), is the
configured one. Rows are streamed batch by batch, never read whole; pyarrow
alone reads them (the ``datasets`` library is not needed). One Parquet cell is
read from its row group's column: a small group whole (kept for the next rows),
a large one (:data:`WHOLE_GROUP_BYTES`) batch by batch from the memory-mapped
file, forward from the last row read, so a cell costs a batch, not the group.
"""

from __future__ import annotations

import functools
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from diffpipe.data.dataset.metadata import DEFAULT_NAMES, relative_path
from diffpipe.utils import read_json_object, stat_stamp

SCHEMES = ("parquet", "arrow")
_LOCATOR = re.compile(r"^(parquet|arrow):(.+)#row=(\d+)&column=([^#&]+)$")
#: ``train-00000-of-00002.parquet``, ``train.parquet``: the hub's split prefix.
_SPLIT_NAME = re.compile(r"^(?P<split>[A-Za-z0-9_.]+?)(-\d{5}-of-\d{5})?$")
#: Rows per streamed batch: a batch of images is held in memory at once.
BATCH_ROWS = 64
#: A row group whose media column holds more than this (uncompressed) is read batch by batch for a cell, not
#: whole: one cell then costs a batch of memory, not the group (a 320 MB group read whole for one cell
#: peaked at 1.6 GB of RSS). Smaller groups are read whole and kept, for neighbouring rows.
WHOLE_GROUP_BYTES = 32 << 20
#: Media bytes a batch of such a group holds, about (one row at least).
STREAM_BATCH_BYTES = 8 << 20


class TableError(ValueError):
    """A table dataset that cannot be read as configured (a sentence naming the file or key)."""


@dataclass(frozen=True)
class Cell:
    """Where one row's media bytes are: table format, file, row in that file, column."""

    fmt: str
    file: str
    row: int
    column: str


@dataclass
class Tables:
    """The table files of one split of a dataset, in row order."""

    fmt: str  # parquet | arrow
    files: list[str]  # absolute, in row order
    split: str
    #: Files that describe the tables (``state.json``, ``dataset_info.json``): Snakemake inputs too.
    extra: list[str] = field(default_factory=list)


def locator(cell: Cell) -> str:
    """The string that names a cell wherever a media path is expected."""
    return f"{cell.fmt}:{cell.file}#row={cell.row}&column={quote(cell.column, safe='')}"


def parse_locator(path: str) -> Cell | None:
    """The cell a locator names; None for a plain file path."""
    if not path.startswith(SCHEMES):
        return None
    m = _LOCATOR.match(path)
    if m is None:
        return None
    return Cell(m[1], m[2], int(m[3]), unquote(m[4]))


def cell_bytes(value: Any) -> bytes | None:
    """The media bytes of a cell value: the ``{bytes, path}`` struct or plain binary; None when empty."""
    if isinstance(value, dict):
        value = value.get("bytes")
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    return None


def read_media(path: str) -> bytes:
    """The media bytes of a file path or of a cell locator.

    Raises:
        OSError: the file (or table) cannot be read, or the cell holds no bytes.
    """
    cell = parse_locator(path)
    if cell is None:
        with open(path, "rb") as f:
            return f.read()
    try:
        value = _cell_value(cell)
    except OSError:
        raise
    except Exception as err:  # pyarrow's errors on a damaged or rewritten table, a missing column
        raise OSError(f"cannot read row {cell.row} of {cell.file}: {err}") from None
    data = cell_bytes(value)
    if data is None:
        raise OSError(f"row {cell.row} of {cell.file} holds no bytes in column {cell.column!r}")
    return data


def _cell_value(cell: Cell) -> Any:
    size, mtime = stat_stamp(cell.file)
    if cell.fmt == "arrow":
        table = _arrow_table(cell.file, size, mtime)
        if not 0 <= cell.row < table.num_rows:
            raise OSError(f"{cell.file} has {table.num_rows} rows, no row {cell.row}")
        return table.column(cell.column)[cell.row].as_py()
    groups = _parquet_groups(cell.file, size, mtime, cell.column)
    for g, (start, n, nbytes) in enumerate(groups):
        if start <= cell.row < start + n:
            if nbytes <= WHOLE_GROUP_BYTES:
                return _parquet_group(cell.file, size, mtime, g, cell.column)[cell.row - start].as_py()
            rows = max(1, min(BATCH_ROWS, STREAM_BATCH_BYTES * n // nbytes))
            return _streamed_cell((cell.file, size, mtime, g, cell.column, rows), cell.row - start)
    raise OSError(f"{cell.file} has {sum(n for _, n, _ in groups)} rows, no row {cell.row}")


@functools.lru_cache(maxsize=4)
def _arrow_table(file: str, size: int, mtime: int) -> Any:
    """A saved ``datasets`` Arrow file, memory-mapped: reading it copies nothing, so rows are
    paged in from disk as they are used (the size and mtime make a changed file a new entry)."""
    import pyarrow as pa  # deferred: pyarrow takes ~0.3 s to import; only datasets with table files need it

    source = pa.memory_map(file, "r")
    try:
        return pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid:  # the IPC file format (with a footer) rather than a stream
        return pa.ipc.open_file(source).read_all()


@functools.lru_cache(maxsize=16)
def _parquet_groups(file: str, size: int, mtime: int, column: str) -> list[tuple[int, int, int]]:
    """(first row, rows, uncompressed bytes of ``column``) of each row group of a Parquet file."""
    import pyarrow.parquet as pq  # deferred: pyarrow takes ~0.3 s to import; only datasets with table files need it

    meta = pq.read_metadata(file)
    leaves = [i for i in range(meta.num_columns)
              if (path := meta.schema.column(i).path) == column or path.startswith(f"{column}.")]
    out, start = [], 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        out.append((start, group.num_rows, sum(group.column(i).total_uncompressed_size for i in leaves)))
        start += group.num_rows
    return out


@functools.lru_cache(maxsize=2)
def _parquet_group(file: str, size: int, mtime: int, group: int, column: str) -> Any:
    """One row group's media column (the cache jobs read neighbouring rows one after another)."""
    import pyarrow.parquet as pq  # deferred: pyarrow takes ~0.3 s to import; only datasets with table files need it

    with pq.ParquetFile(file) as f:
        return f.read_row_group(group, columns=[column]).column(column)


class _GroupCursor:
    """One large row group's column, read forward in batches: only the current batch is in memory."""

    def __init__(self, key: tuple[str, int, int, int, str, int]):
        import pyarrow.parquet as pq  # deferred: pyarrow takes ~0.3 s to import; only datasets with table files need it

        file, _, _, group, column, rows = self.key = key
        # Memory-mapped, not pre-buffered: an uncompressed page is read as a slice of the map, so only the
        # pages of the rows read are touched (a read buffer would copy each page, and without one the
        # reader copies the whole column chunk first).
        self._file = pq.ParquetFile(file, memory_map=True, pre_buffer=False)
        self._batches = self._file.iter_batches(batch_size=rows, row_groups=[group], columns=[column])
        self.start, self.batch = 0, None  # rows of the group before ``batch``

    def get(self, row: int) -> Any:
        """Row ``row`` of the group (not before the current batch)."""
        while self.batch is None or row >= self.start + self.batch.num_rows:
            self.start += 0 if self.batch is None else self.batch.num_rows
            self.batch = next(self._batches, None)
            if self.batch is None:
                raise OSError(f"{self.key[0]}: row group {self.key[3]} ended before its row {row}")
        return self.batch.column(0)[row - self.start].as_py()

    def close(self) -> None:
        self.batch = None
        self._file.close()


_CURSOR: list[_GroupCursor] = []  # at most one: the last large group read
_CURSOR_LOCK = threading.Lock()  # the cache jobs may decode in threads


def _streamed_cell(key: tuple[str, int, int, int, str, int], row: int) -> Any:
    """Row ``row`` of a large row group: forward from the last row read when it is ahead (the cache jobs
    read table rows in order), else from the group's first row again."""
    with _CURSOR_LOCK:
        if _CURSOR and (_CURSOR[0].key != key or row < _CURSOR[0].start):
            _CURSOR.pop().close()
        if not _CURSOR:
            _CURSOR.append(_GroupCursor(key))
        return _CURSOR[0].get(row)


# -- layouts -------------------------------------------------------------------------------------
def _json(path: Path) -> dict[str, Any]:
    try:
        return read_json_object(path)
    except ValueError as err:
        raise TableError(f"{err}; the datasets library writes it as a JSON object") from None


def _saved_dataset(folder: Path, split: str) -> Tables:
    state = _json(folder / "state.json")
    names = [f.get("filename") for f in state.get("_data_files") or [] if isinstance(f, dict)]
    if not names or not all(isinstance(n, str) and relative_path(folder, n) == n for n in names):
        raise TableError(f"{folder / 'state.json'} lists no data files (`_data_files`) inside {folder}")
    files = [str(folder / n) for n in names]
    extra = [str(folder / n) for n in ("state.json", "dataset_info.json") if (folder / n).is_file()]
    return Tables("arrow", files, state.get("_split") or split, extra)


def _split_of(rel: str) -> str | None:
    """The split a hub Parquet file belongs to, from its name or its folder; None when unnamed."""
    parts = rel.split("/")
    m = _SPLIT_NAME.match(parts[-1].removesuffix(".parquet"))
    if m and not m["split"].isdigit():
        return m["split"]
    return parts[-2] if len(parts) > 1 and parts[-2] != "data" else None


def parquet_files(root: Path) -> list[str]:
    """Every ``*.parquet`` below ``root`` (relative, sorted), hidden files and metadata tables aside."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        rel = os.path.relpath(folder, root)
        for name in files:
            if name.endswith(".parquet") and not name.startswith(".") and name not in DEFAULT_NAMES:
                found.append(name if rel == "." else f"{rel}/{name}".replace(os.sep, "/"))
    return sorted(found)


def find_tables(root: Path, split: str, *, parquet: bool) -> Tables | None:
    """The table files of ``split`` in ``root``; None when ``root`` is no table dataset.

    ``parquet``: read Parquet shards (only when the folder holds no media files).

    Raises:
        TableError: a table layout whose split or state cannot be read.
    """
    if (root / "dataset_dict.json").is_file():
        splits = _json(root / "dataset_dict.json").get("splits") or []
        if split not in splits or relative_path(root, split) != split:
            raise TableError(f"{root / 'dataset_dict.json'} has splits {splits}, not {split!r}; set datasets[].split")
        tables = _saved_dataset(root / split, split)
        tables.extra.append(str(root / "dataset_dict.json"))
        return tables
    if (root / "state.json").is_file() and (root / "dataset_info.json").is_file():  # both: a saved Dataset
        return _saved_dataset(root, split)
    if not parquet:
        return None
    files = parquet_files(root)
    if not files:
        return None
    named = {f: _split_of(f) for f in files}
    splits = sorted({s for s in named.values() if s})
    chosen = [f for f, s in named.items() if s == split] if splits else files
    if not chosen:
        raise TableError(f"the Parquet files in {root} hold the splits {splits}, not {split!r}; set datasets[].split")
    return Tables("parquet", [str(root / f) for f in chosen], split)


# -- streaming rows ------------------------------------------------------------------------------
def schema_of(tables: Tables) -> dict[str, Any]:
    """Column name -> Arrow type, from the first table file.

    Raises:
        TableError: the file is missing or unreadable (naming it).
    """
    # deferred: pyarrow takes ~0.3 s to import; only datasets with table files need it
    import pyarrow as pa
    import pyarrow.parquet as pq

    first = tables.files[0]
    try:
        if tables.fmt == "parquet":
            schema = pq.read_schema(first)
        else:
            with pa.memory_map(first, "r") as source:
                schema = pa.ipc.open_stream(source).schema
    except FileNotFoundError:
        raise TableError(f"table file {first} does not exist") from None
    except Exception as err:
        raise TableError(f"table file {first} cannot be read ({err})") from None
    return {f.name: f.type for f in schema}


def iter_rows(tables: Tables, columns: list[str]) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """``(file, row in file, {column: value})`` for every row, streamed in batches.

    Raises:
        TableError: a table file cannot be read (naming it).
    """
    # deferred: pyarrow takes ~0.3 s to import; only datasets with table files need it
    import pyarrow as pa
    import pyarrow.parquet as pq

    for file in tables.files:
        try:
            if tables.fmt == "parquet":
                with pq.ParquetFile(file) as f:
                    batches = f.iter_batches(batch_size=BATCH_ROWS, columns=columns)
                    yield from _rows(file, batches, columns)
            else:
                with pa.memory_map(file, "r") as source:
                    yield from _rows(file, pa.ipc.open_stream(source), columns)
        except TableError:
            raise
        except Exception as err:
            raise TableError(f"table file {file} cannot be read ({type(err).__name__}: {err})") from None


def _rows(file: str, batches: Any, columns: list[str]) -> Iterator[tuple[str, int, dict[str, Any]]]:
    n = 0
    for batch in batches:
        cols = {c: batch.column(batch.schema.get_field_index(c)) for c in columns}
        for i in range(batch.num_rows):
            yield file, n, {c: col[i].as_py() for c, col in cols.items()}
            n += 1
