"""Manifest rows of a table dataset (:mod:`diffpipe.data.dataset.tables`): one per table row.

A row's item id is a digest of the dataset name and the SHA-256 of its media
bytes (``#k`` for the k-th repeat of the same bytes), not of its position: rows
reordered, inserted or spread over other shards keep their ids, so their
probe results, shard and cache entries stay; a row whose image changes is a new
item (its old entry leaves its shard). Editing a caption keeps the id, so it
re-encodes one text entry and no latent. The media bytes are hashed on every
validation (that is how a change is seen: tables have no per-row mtime);
decoding, the costly part, runs only for content not validated before.

The manifest row's ``path`` is the cell's locator (file, row, column), its
``relpath`` ``<split>/<n>`` (n-th row of the split: what ``eval_files`` names).
The captions come from the caption column, read like a metadata cell.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from diffpipe.config import DatasetConfig
from diffpipe.data.dataset import captions as cap
from diffpipe.data.dataset.checks import PROBE_REASONS, add_reason
from diffpipe.data.dataset.metadata import CAPTION_COLUMNS, pick_column
from diffpipe.data.dataset.tables import Cell, TableError, Tables, cell_bytes, iter_rows, locator, schema_of
from diffpipe.utils import digest, stat_stamp

#: Manifest fields a probe fills, reused with the hash.
PROBE_KEYS = ("sha256", "kind", "width", "height", "frames", "fps")


def item_key(sha256: str, repeat: int) -> str:
    """What a table row's item id is a digest of: its media content and which copy of it it is."""
    return f"sha256:{sha256}" + (f"#{repeat}" if repeat else "")


def media_column(ds: DatasetConfig, columns: list[str], types: dict[str, Any]) -> str | None:
    """The configured media column, else ``image`` (``video``), else the only column of media bytes."""
    if want := ds.video_column or ds.image_column:
        return want if want in columns else None
    default = "image"
    if default in columns:
        return default
    media = [c for c in columns if _holds_bytes(types[c])]
    return media[0] if len(media) == 1 else None


def _holds_bytes(typ: Any) -> bool:
    import pyarrow as pa  # deferred: pyarrow takes ~0.3 s to import; only datasets with table files need it

    if pa.types.is_struct(typ):
        return any(typ.field(i).name == "bytes" for i in range(typ.num_fields))
    return pa.types.is_binary(typ) or pa.types.is_large_binary(typ)


def collect(
    ds: DatasetConfig,
    tables: Tables,
    root: Path,
    lookup: Callable[[list[str]], dict[str, dict[str, Any]]],
    reuse_probe: bool,
    issue: Any,
    chunk: int,
    covered: Callable[[str, int, int], Any] | None = None,
) -> Iterator[tuple[list[dict[str, Any]], list[tuple[int, str, str]], dict[str, dict[str, Any]]]]:
    """Manifest rows (captions attached, probe results reused by content), ``chunk`` rows at a time: each
    chunk's rows, the cells among them to probe (index, locator, kind) and the previous manifest's rows of
    their item ids (``lookup``).

    ``covered(file relpath, size, mtime)``: a validation shard's rows of a table file
    (:func:`diffpipe.data.dataset.tshards.file_probes`), or None; a covered file's media column is not read,
    its rows take their hash and probe results from there."""
    found = _columns(ds, tables, root, issue)
    if found is None:
        return
    media, cap_col, kind = found
    rows: list[dict[str, Any]] = []
    shas: list[str | None] = []
    copies = Repeats(_repeated(covered, root, tables.files))
    n = 0
    try:
        for file in tables.files:
            probed = _covered(covered, root, file)
            if probed is None and copies.only is not None:  # its shard's rows were read a moment ago
                raise TableError(f"{file} changed while it was validated; run validation again")
            one = Tables(tables.fmt, [file], tables.split, tables.extra)
            cells = iter_rows(one, [cap_col] if probed is not None else [media, cap_col])
            for k, (_, index, values) in enumerate(cells):
                where = f"row {index} of {os.path.basename(file)}"
                loc = locator(Cell(tables.fmt, file, index, media))
                if probed is not None:
                    if k >= len(probed):  # the stamp matched, yet the file has more rows: rewritten in place
                        raise TableError(f"{file} has more rows than its validation shard recorded; run "
                                         "validation again (the shard's job rereads it)")
                    row, sha = _probed_row(ds, f"{tables.split}/{n}", loc, probed[k], kind, copies)
                else:
                    row, sha = _row(ds, f"{tables.split}/{n}", loc, where, values[media], kind, copies)
                _caption(ds, row, values[cap_col], f"{where}, column {cap_col!r},")
                rows.append(row)
                shas.append(None if row.get("_reused") else sha)
                n += 1
                if len(rows) == chunk:
                    yield _reuse_or_queue(rows, shas, lookup, reuse_probe)
                    rows, shas = [], []
    except TableError as err:
        issue(str(root), "bad_metadata", str(err))
    if rows:
        yield _reuse_or_queue(rows, shas, lookup, reuse_probe)


class Repeats:
    """Which copy of its content each row is (the ``#k`` of :func:`item_key`), over the whole dataset in row
    order. Given ``only``, the 60-bit prefixes of the hashes that occur more than once (:func:`_repeated`),
    only those hashes are counted and every other row is the first copy: a counter over every hash held
    about 150 bytes a row (1.5 GB at 10 million rows) for the few that repeat."""

    def __init__(self, only: set[int] | None = None) -> None:
        self.only = only
        self.counts: Counter[str] = Counter()

    def next(self, sha: str) -> int:
        if self.only is not None and int(sha[:15], 16) not in self.only:
            return 0
        k = self.counts[sha]
        self.counts[sha] = k + 1
        return k


def _repeated(covered: Callable[[str, int, int], Any] | None, root: Path, files: list[str]) -> set[int] | None:
    """The 60-bit prefixes of the hashes found more than once in the validation shards' rows of ``files``
    (column-wise, 8 bytes a row while it runs); None when a file is not covered (its hashes are known only
    once its media is read: every hash is counted then). Each shard's table is read here and once more by the
    scan (one shard's table is held at a time): the I/O of the probe tables twice, for a set of the repeats."""
    parts = []
    for file in files:
        rows = _covered_frame(covered, root, file)
        if rows is None:
            return None
        parts.append(rows["sha256"].drop_nulls().str.slice(0, 15).str.to_integer(base=16))
    if not parts:
        return set()
    prefixes = parts[0]
    for part in parts[1:]:
        prefixes.append(part)  # in place: no module import of polars here (its import costs start-up time)
    return set(prefixes.filter(prefixes.is_duplicated()).unique().to_list())


def _covered_frame(covered: Callable[[str, int, int], Any] | None, root: Path, file: str) -> Any:
    """A validation shard's rows of ``file`` (a polars table in row order); None when no shard covered the
    file as it is now."""
    if covered is None:
        return None
    try:
        size, mtime = stat_stamp(file)
    except OSError:
        return None
    return covered(os.path.relpath(file, root), size, mtime)


def _covered(covered: Callable[[str, int, int], Any] | None, root: Path, file: str) -> list[tuple[Any, ...]] | None:
    """A validation shard's rows of ``file`` as tuples (sha256, size, kind, width, height, frames, fps, reasons,
    notes), in row order; None when no shard covered the file as it is now."""
    rows = _covered_frame(covered, root, file)
    if rows is None:
        return None
    return list(rows.select("sha256", "size", "kind", "width", "height", "frames", "fps", "reasons", "notes")
                .iter_rows())


def _probed_row(ds: DatasetConfig, rel: str, loc: str, probe: tuple[Any, ...], kind: str,
                copies: Repeats) -> tuple[dict[str, Any], str | None]:
    """A row of a covered file: its hash and probe results come from its validation shard."""
    sha, size, *_, reasons, notes = probe
    row = _row_of(ds, rel, loc, sha, size, kind, copies)
    if sha is None:  # no bytes in the cell: the shard wrote its missing_file note
        for reason, note in zip(reasons, notes, strict=True):
            add_reason(row, reason, note)
        return row, None
    _reuse(row, dict(zip(("sha256", "size", *PROBE_KEYS[1:], "reasons", "notes"), probe, strict=True)))
    return row, sha


def _columns(ds: DatasetConfig, tables: Tables, root: Path, issue: Any) -> tuple[str, str, str] | None:
    """The media column, the caption column and the kind of the table's items; None (with issues) when the
    table cannot be read as items."""
    try:
        types = schema_of(tables)
    except TableError as err:
        issue(str(root), "bad_metadata", str(err))
        return None
    columns = list(types)
    kind = "video" if ds.video_column else "image"
    media = media_column(ds, columns, types)
    cap_col = pick_column(columns, ds.caption_column, CAPTION_COLUMNS)
    have = ", ".join(columns) or "none"
    first = tables.files[0]
    if media is None:
        key = f"{kind}_column"
        wanted = repr(getattr(ds, key)) if getattr(ds, key) else "'image' or a single column of media bytes"
        issue(first, "bad_metadata", f"table {first} has no {kind} column {wanted} (columns: {have}); "
              f"set datasets[{ds.name}].{key}")
    if cap_col is None:
        wanted = repr(ds.caption_column) if ds.caption_column else f"one of {', '.join(CAPTION_COLUMNS)}"
        issue(first, "bad_metadata", f"table {first} has no caption column {wanted} (columns: {have}); "
              f"set datasets[{ds.name}].caption_column")
    if ds.aux_roles():
        issue(str(root), "bad_metadata", f"datasets[{ds.name}]: masks and control images are read from folders "
              "or metadata files only, not from table columns; remove mask_*/control_* or use a folder of files")
    if media is None or cap_col is None:
        return None
    return media, cap_col, kind


def _reuse_or_queue(
    rows: list[dict[str, Any]], shas: list[str | None], lookup: Any, reuse_probe: bool
) -> tuple[list[dict[str, Any]], list[tuple[int, str, str]], dict[str, dict[str, Any]]]:
    """A chunk's rows with the probe results of content validated before, the cells left to probe, and
    the previous rows of the chunk's ids."""
    previous = lookup([row["id"] for row in rows])
    jobs: list[tuple[int, str, str]] = []
    for i, (row, sha) in enumerate(zip(rows, shas, strict=True)):
        prev = previous.get(row["id"])
        if sha is None:
            continue  # no bytes: nothing to probe (missing_file)
        if reuse_probe and prev and prev["sha256"] == sha:
            _reuse(row, prev)
        else:
            jobs.append((i, row["path"], row["kind"]))
    return rows, jobs, previous


def _row(
    ds: DatasetConfig, rel: str, loc: str, where: str, cell: Any, kind: str, copies: Repeats
) -> tuple[dict[str, Any], str | None]:
    """A row's manifest fields before probing, and the SHA-256 of its media bytes (None: no bytes)."""
    data = cell_bytes(cell)
    sha = hashlib.sha256(data).hexdigest() if data is not None else None
    row = _row_of(ds, rel, loc, sha, len(data) if data is not None else 0, kind, copies)
    if data is None:
        add_reason(row, "missing_file", missing_note(where, cell, kind))
    return row, sha


def missing_note(where: str, cell: Any, kind: str) -> str:
    """The ``missing_file`` note of a cell without media bytes."""
    named = cell.get("path") if isinstance(cell, dict) else None
    only = f" (only a path, {named!r}: store the {kind} bytes in the table)" if named else ""
    return f"{where}: the cell holds no {kind} bytes{only}"


def _row_of(ds: DatasetConfig, rel: str, loc: str, sha: str | None, size: int, kind: str,
            copies: Repeats) -> dict[str, Any]:
    """A row's manifest fields before probing; its id numbers repeats of ``sha`` over the whole dataset."""
    if sha is not None:
        key = item_key(sha, copies.next(sha))
    else:
        key = f"row:{rel}"
    return {
        "id": digest([ds.name, key])[:16],
        "dataset": ds.name,
        "path": loc,
        "relpath": rel,
        "kind": kind,
        "size": size,
        "mtime_ns": None,
        **dict.fromkeys(("sha256", "width", "height", "frames", "fps")),
        "reasons": [],
        "notes": [],
        **dict.fromkeys(("caption_file", "caption_size", "caption_mtime_ns")),
        "_draw": key,  # the eval_fraction draw follows the content, not the row's position
    }


def _reuse(row: dict[str, Any], prev: dict[str, Any]) -> None:
    """Take the probe results of the same content from the previous manifest."""
    for k in PROBE_KEYS:
        row[k] = prev[k]
    for reason, note in zip(prev["reasons"], prev["notes"], strict=True):
        if reason in PROBE_REASONS:
            add_reason(row, reason, note)
    row["_reused"] = True


def _caption(ds: DatasetConfig, row: dict[str, Any], cell: Any, where: str) -> None:
    """Attach the caption cell's alternatives (or its reason) to the row, as for a metadata cell."""
    c = cap.from_metadata(cell, where=where, lines=ds.caption_lines, style=ds.caption_style)
    if c.reason:
        add_reason(row, c.reason, c.note)
    texts = list(c.texts)
    row.update(captions=texts, caption=texts[0] if texts else "", caption_sha256=cap.caption_hash(texts))
