"""Table datasets in validation shards: a shard job hashes and probes the rows of its table files.

A table dataset (Parquet shards, a saved or hub dataset) is split by table file: the validation
shard of a file is :func:`diffpipe.data.dataset.discover.vshard_of` of the dataset name and the
file's path relative to the dataset root, as for a media file of a folder. The shard job reads
each of its files' media column row by row, hashes the bytes, probes (decodes) only content its
previous table did not cover (by SHA-256), and writes one probe-table row per table row
(:data:`diffpipe.data.dataset.probe_table.PROBE_SCHEMA`): ``relpath`` is ``<file>#row=<n>``
(:func:`row_relpath`), ``size`` the media bytes' length, ``mtime_ns`` the table file's mtime. A file
whose size and mtime match what the previous table recorded (its metadata ``table_files``) keeps its
rows unread.

The merging ``validate`` job then reads, per table file, only the caption column and these rows
(:func:`file_probes`): it never holds the media bytes of a covered file. It assigns the item ids
(the repeat count per SHA-256 runs over the whole dataset, in row order, exactly as when it reads the
media itself) and runs the whole-table checks. A file whose rows are missing, incomplete, of another
mtime or with a reason other than a content reason (a cell without bytes) is read by the merging
job as in a single job.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import polars as pl

from diffpipe.config import DatasetConfig, ValidationConfig
from diffpipe.data.dataset.discover import vshard_of
from diffpipe.data.dataset.pool import probe_files
from diffpipe.data.dataset.probe_table import PROBE_SCHEMA, read_probe_meta, reusable
from diffpipe.data.dataset.tables import Cell, Tables, cell_bytes, iter_rows, locator

_ROW = "#row="
_PROBED = ("kind", "width", "height", "frames", "fps", "reasons", "notes")


def row_relpath(file_rel: str, row: int) -> str:
    """The probe table's ``relpath`` of row ``row`` of the table file ``file_rel``."""
    return f"{file_rel}{_ROW}{row}"


def _quiet(*_: Any) -> None:
    """Issues of a table that cannot be read are the merging job's to report (it reads the file itself)."""


def shard_rows(ds: DatasetConfig, root: str, rel: str, fmt: str, size: int, mtime: int,
               previous: pl.DataFrame | None, old_stamp: list[int] | None, vcfg: ValidationConfig,
               workers: int | None, console: Any) -> tuple[pl.DataFrame | None, int]:
    """The probe rows of one table file (None when its media column cannot be found: the merge reads it)
    and how many cells were probed."""
    from diffpipe.data.dataset import table_items  # deferred: its imports reach the caption readers

    mine = None
    if previous is not None:
        mine = previous.filter((pl.col("dataset") == ds.name) & pl.col("relpath").str.starts_with(rel + _ROW))
        if old_stamp == [size, mtime] and mine.height and (mine["mtime_ns"] == mtime).all():
            return mine, 0  # the file is unchanged since its rows were written
    tables = Tables(fmt, [os.path.join(root, rel)], ds.split)
    found = table_items._columns(ds, tables, Path(root), _quiet)
    if found is None:
        return None, 0
    media, _, kind = found
    known = _by_sha(previous, ds.name)
    rels, shas, sizes, jobs, missing = [], [], [], {}, {}
    for file, index, values in iter_rows(tables, [media]):
        data = cell_bytes(values[media])
        sha = _sha(data)
        rels.append(row_relpath(rel, index))
        shas.append(sha)
        sizes.append(len(data) if data is not None else 0)
        if sha is None:  # the merge reports it, with the note a single job writes
            where = f"row {index} of {os.path.basename(file)}"
            missing[len(rels) - 1] = table_items.missing_note(where, values[media], kind)
        elif sha not in known and sha not in jobs:
            jobs[sha] = locator(Cell(fmt, file, index, media))
    probes = probe_files([(loc, kind) for loc in jobs.values()], vcfg.max_pixels, workers, console)
    for sha, p in zip(jobs, probes, strict=True):
        known[sha] = (p["kind"] or kind, p["width"], p["height"], p["frames"], p["fps"],
                      [r for r, _ in p["problems"]], [n for _, n in p["problems"]])

    def probed(i: int, sha: str | None) -> tuple[Any, ...]:
        return known[sha] if sha else (kind, None, None, None, None, ["missing_file"], [missing[i]])

    cols = list(zip(*(probed(i, s) for i, s in enumerate(shas)), strict=True)) or [[] for _ in _PROBED]
    return pl.DataFrame({"dataset": [ds.name] * len(rels), "relpath": rels, "size": sizes,
                         "mtime_ns": [mtime] * len(rels), "sha256": shas, **dict(zip(_PROBED, cols, strict=True))},
                        schema=_schema()), len(jobs)


def _sha(data: bytes | None) -> str | None:
    return hashlib.sha256(data).hexdigest() if data is not None else None


def _schema() -> dict[str, Any]:
    return dict(pl.from_arrow(PROBE_SCHEMA.empty_table()).schema)


def _by_sha(previous: pl.DataFrame | None, dataset: str) -> dict[str, tuple[Any, ...]]:
    """Probe results of the previous table's table rows of ``dataset``, by content (only reusable ones)."""
    if previous is None:
        return {}
    rows = previous.filter((pl.col("dataset") == dataset) & pl.col("relpath").str.contains(_ROW, literal=True)
                           & reusable()).unique("sha256", keep="first", maintain_order=True)
    return {r[0]: r[1:] for r in rows.select("sha256", *_PROBED).iter_rows()}


def table_stamps(table_meta: dict[bytes, bytes] | None) -> dict[str, list[int]]:
    """``{"<dataset>/<file>": [size, mtime_ns]}`` recorded in a probe table's metadata."""
    try:
        return json.loads((table_meta or {}).get(b"table_files", b"{}"))
    except ValueError:
        return {}


def stamp_key(dataset: str, rel: str) -> str:
    return json.dumps([dataset, rel])


def file_probes(paths: list[Path], vcfg: ValidationConfig, shards: int) -> Any:
    """For the merging job: a function (dataset, file relpath, size, mtime) -> the file's probe rows in row
    order (sha256, size and the probe columns), or None when the shards did not cover the file whole."""
    last: dict[int, tuple[pl.DataFrame, dict[str, list[int]]] | None] = {}

    def find(dataset: str, rel: str, size: int, mtime: int) -> pl.DataFrame | None:
        if not paths:
            return None
        index = vshard_of(dataset, rel, shards)
        if index not in last:
            last.clear()  # one shard's table at a time: files of a shard are read one after another
            got = read_probe_meta(paths[index], vcfg)
            last[index] = None if got is None else (
                got[0].filter(pl.col("relpath").str.contains(_ROW, literal=True)), table_stamps(got[1]))
        held = last[index]
        if held is None or held[1].get(stamp_key(dataset, rel)) != [size, mtime]:
            return None
        rows = held[0].filter((pl.col("dataset") == dataset) & pl.col("relpath").str.starts_with(rel + _ROW))
        rows = rows.with_columns(_n=pl.col("relpath").str.slice(len(rel) + len(_ROW)).cast(pl.Int64)).sort("_n")
        complete = rows.height and (rows["_n"] == pl.int_range(rows.height, eager=True)).all()
        usable = reusable() | (pl.col("sha256").is_null() & (pl.col("reasons") == pl.lit(["missing_file"])))
        if not complete or not rows.select(usable.all()).item() or not (rows["mtime_ns"] == mtime).all():
            return None
        return rows.drop("_n")

    return find
