"""Validation split across jobs: each validation shard probes its part of the listing, one job merges.

Probing (hashing and decoding every new or changed media file) is what grows with
the dataset; the checks over probed rows (captions, geometry, splits, tokens,
duplicates) are cheap but need every row. So with ``validation.shards: N > 1``
the listing is split by path hash into N validation shards (``v0000``...): the
shard of a file is its item id (:func:`diffpipe.data.dataset.validate.item_id`,
a digest of dataset name and relative path) modulo N, so a file stays in its
shard while others come and go. Each shard is its own Snakemake job (a cluster
profile spreads them over nodes) writing a probe table
``validate/probe/<vshard>.parquet`` (:data:`PROBE_SCHEMA`); the ``validate``
job then reuses every probe whose file still has the recorded size and mtime,
exactly as it reuses its previous manifest, and probes only what no shard
covered. Each shard's input is its own listing fingerprint
(``validate/listing/<vshard>.fingerprint``, written by
:func:`diffpipe.workflow.dataset_fingerprint`), so a changed file reruns only
its shard's job; that job reuses its previous table for its unchanged files
(a join on dataset, path, size and mtime). The listing file holds the shard's
files (path, kind, size, mtime), so a shard job reads them there instead of
listing the whole dataset to keep its part (with 100 shards, 100 walks);
run by hand without that file, the job lists the dataset itself.

Table datasets (Parquet, saved or hub datasets) are split by table file: the
listing gives a shard its table files (kind ``parquet`` / ``arrow``, the file's
size and mtime), and the shard writes one row per table row into the same table
(:mod:`diffpipe.data.dataset.tshards`); the merging job reads those rows and the
caption column instead of the media. Mask and control images are probed by the
merging job, as in a single job.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console

from diffpipe.config import DatasetConfig, ValidationConfig
from diffpipe.data.dataset import tshards
from diffpipe.data.dataset.discover import dataset_root, list_dataset, vshard_name, vshard_names, vshard_of
from diffpipe.data.dataset.pool import probe_files
from diffpipe.data.dataset.probe_table import PROBE_SCHEMA, TABLE_KINDS, read_probe, read_probe_table, reusable
from diffpipe.data.dataset.validate import probe_key
from diffpipe.utils import atomic_path

_KEYS = ["dataset", "relpath", "size", "mtime_ns"]


def vshard_index(name: str, shards: int) -> int:
    """The index of shard ``name``, with an error naming the accepted names."""
    if name not in vshard_names(shards):
        raise ValueError(f"validation shard {name!r} does not exist: validation.shards is {shards} "
                         f"(shards v0000 to {vshard_name(shards - 1)}, only when shards > 1)")
    return int(name[1:])


@dataclass
class ShardResult:
    """One validation shard's counts."""

    files: int = 0  # media files of the shard
    probed: int = 0  # read this run
    reused: int = 0  # taken from the shard's previous table (size and mtime unchanged)
    changed: bool = False  # the table was rewritten
    table_rows: int = 0  # rows of table files (tshards)
    table_rows_probed: int = 0  # of which content decoded this run


#: A shard's listing: one row per media file.
_LISTING_SCHEMA = {"dataset": pl.String, "relpath": pl.String, "kind": pl.String, "size": pl.Int64,
                   "mtime_ns": pl.Int64}


def _listing_frame(datasets: list[DatasetConfig], vcfg: ValidationConfig, index: int, shards: int,
                   exclude: tuple[str, ...]) -> tuple[pl.DataFrame, dict[str, str]]:
    """The shard's media files (dataset, relpath, size, mtime_ns, kind by extension) and each dataset's root."""
    parts: dict[str, list[Any]] = {col: [] for col in _LISTING_SCHEMA}
    roots: dict[str, str] = {}
    for ds in datasets:
        listing = list_dataset(ds, vcfg, with_stats=True, exclude=exclude)
        if not listing.root_ok:
            continue  # nothing to probe here: the merging job reports it
        roots[ds.name] = str(listing.root)
        media = listing.media
        if listing.table is not None:  # table files, by their format (tshards)
            media = {os.path.relpath(f, listing.root): listing.table.fmt for f in listing.table.files}
        for rel, kind in media.items():
            if vshard_of(ds.name, rel, shards) != index:
                continue
            size, mtime = listing.stats.get(rel, (0, 0))
            for col, value in zip(parts, (ds.name, rel, kind, size, mtime), strict=True):
                parts[col].append(value)
    return pl.DataFrame(parts, schema=_LISTING_SCHEMA), roots


def read_listing(path: Path | None, datasets: list[DatasetConfig], shard: str,
                 shards: int) -> tuple[pl.DataFrame, dict[str, str]] | None:
    """Shard ``shard``'s media files as the workflow listed them (:func:`diffpipe.workflow.dataset_fingerprint`)
    and each dataset's root, as :func:`_listing_frame` gives them; None when the file is absent, damaged, or
    written for another shard count or other datasets (the job then lists the datasets itself)."""
    try:
        data = json.loads(Path(path).read_text()) if path else None
    except (OSError, ValueError):
        return None
    roots = data.get("roots") if isinstance(data, dict) else None
    if not isinstance(roots, dict) or (data.get("shard"), data.get("shards")) != (shard, shards):
        return None
    by_name = {ds.name: ds for ds in datasets}
    if any(name not in by_name or dataset_root(by_name[name])[0] != Path(root) for name, root in roots.items()):
        return None
    try:
        frame = pl.DataFrame(data["files"], schema=_LISTING_SCHEMA, orient="row")
    except (KeyError, TypeError, ValueError, pl.exceptions.PolarsError):
        return None
    # Paths as the walk writes them: relative, inside the dataset folder (it skips dot entries).
    inside = ~frame["relpath"].str.contains(r"(^/|(^|/)\.)")
    return (frame, roots) if (frame["dataset"].is_in(list(roots)) & inside).all() else None


def run_shard(datasets: list[DatasetConfig], vcfg: ValidationConfig, *, shard: str, shards: int, out_path: Path,
              exclude: tuple[str, ...] = (), rehash: bool = False, workers: int | None = None,
              console: Console | None = None, listing_path: Path | None = None) -> ShardResult:
    """Probe validation shard ``shard``'s new or changed media files; write its probe table.

    The shard's files come from ``listing_path`` (the workflow's listing, :func:`read_listing`)
    when it is there and fits, else from listing the datasets. Files whose dataset, path, size and
    mtime match a row of the shard's previous table (``out_path``) keep that row (unless
    ``rehash``); the rest are probed by the worker pool. The table is rewritten only when its
    content changes.
    """
    index, key = vshard_index(shard, shards), probe_key(vcfg)
    listed = read_listing(listing_path, datasets, shard, shards)
    listing, roots = listed or _listing_frame(datasets, vcfg, index, shards, exclude)
    got = None if rehash else read_probe(out_path, key)
    previous, old_meta = got or (None, {})
    is_table = pl.col("kind").is_in(TABLE_KINDS)
    tables, listing = listing.filter(is_table), listing.filter(~is_table)
    table_rows, stamps, decoded = _table_rows(datasets, vcfg, tables, roots, previous, old_meta, workers, console)
    if previous is not None:
        previous = previous.filter(~pl.col("relpath").str.contains("#row=", literal=True))
    if previous is not None:
        # The previous row of the same file, unchanged since (same size and mtime): reused as it is,
        # with the kind its probe found (content sniffing may correct the extension's guess).
        joined = listing.join(previous.rename({"kind": "kind_probed"}), on=_KEYS, how="left")
        hit = reusable()
        reused = joined.filter(hit).with_columns(pl.col("kind_probed").alias("kind")).select(PROBE_SCHEMA.names)
        todo = joined.filter(~hit).select(*_KEYS, "kind")
    else:
        reused, todo = _empty(), listing
    probes = probe_files([(os.path.join(roots[d], r), k) for d, r, k in todo.select("dataset", "relpath", "kind")
                          .iter_rows()], vcfg.max_pixels, workers, console)
    fresh = todo.with_columns(
        pl.Series("kind", [p["kind"] or k for p, k in zip(probes, todo["kind"], strict=True)], dtype=pl.String),
        *(pl.Series(c, [p[c] for p in probes], dtype=reused.schema[c]) for c in ("sha256", "width", "height",
                                                                                   "frames", "fps")),
        pl.Series("reasons", [[r for r, _ in p["problems"]] for p in probes], dtype=pl.List(pl.String)),
        pl.Series("notes", [[n for _, n in p["problems"]] for p in probes], dtype=pl.List(pl.String)),
    ).select(PROBE_SCHEMA.names)
    table = pl.concat([reused, fresh, *table_rows]).sort("dataset", "relpath").to_arrow()
    meta = {"probe_key": key, "shard": shard, "shards": str(shards), "table_files": json.dumps(stamps, sort_keys=True)}
    table = table.cast(PROBE_SCHEMA.with_metadata(meta))
    changed = _write_table(out_path, table)
    rows = sum(t.height for t in table_rows)
    return ShardResult(files=listing.height + tables.height, probed=todo.height, reused=reused.height,
                       changed=changed, table_rows=rows, table_rows_probed=decoded)


def _table_rows(datasets: list[DatasetConfig], vcfg: ValidationConfig, tables: pl.DataFrame, roots: dict[str, str],
                previous: pl.DataFrame | None, old_meta: dict[bytes, bytes], workers: int | None,
                console: Console | None) -> tuple[list[pl.DataFrame], dict[str, list[int]], int]:
    """The probe rows of the shard's table files (:mod:`~diffpipe.data.dataset.tshards`), and each file's
    size and mtime as read (the merge trusts the rows only for a file still of that size and mtime)."""
    by_name = {ds.name: ds for ds in datasets}
    old = tshards.table_stamps(old_meta)
    parts, stamps, decoded = [], {}, 0
    for name, rel, fmt, size, mtime in tables.select("dataset", "relpath", "kind", "size", "mtime_ns").iter_rows():
        key = tshards.stamp_key(name, rel)
        rows, probed = tshards.shard_rows(by_name[name], roots[name], rel, fmt, size, mtime, previous, old.get(key),
                                          vcfg, workers, console)
        decoded += probed
        if rows is not None:
            parts.append(rows)
            stamps[key] = [size, mtime]
    return parts, stamps, decoded


def _empty() -> pl.DataFrame:
    return pl.from_arrow(PROBE_SCHEMA.empty_table())


def _write_table(path: Path, table: pa.Table) -> bool:
    """Write ``table`` unless the file holds it already (then only touch it, for Snakemake)."""
    if path.is_file():
        try:
            with pq.ParquetFile(path) as f:
                old = f.read()
            same = old.equals(table) and old.schema.metadata == table.schema.metadata
        except Exception:
            same = False
        if same:
            os.utime(path)
            return False
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
    return True


def load_probes(paths: list[Path], vcfg: ValidationConfig) -> pl.DataFrame | None:
    """The reusable rows of every validation shard's probe table, as one table (:data:`PROBE_SCHEMA`'s
    columns); None when there is none. Tables of another probe key are ignored (their files are probed
    again by the merging job, which joins this table to each folder's listing:
    :func:`diffpipe.data.dataset.columnar.align`)."""
    key = probe_key(vcfg)
    # Table rows (tshards) are read per table file by the merge, not joined here.
    folder = reusable() & ~pl.col("relpath").str.contains("#row=", literal=True)
    frames = [df.filter(folder) for p in paths if (df := read_probe_table(Path(p), key)) is not None]
    return pl.concat(frames) if frames else None
