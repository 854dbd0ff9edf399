"""The probe table a validation shard writes (:mod:`diffpipe.data.dataset.vshards`), read by the shard
jobs, the table shards (:mod:`diffpipe.data.dataset.tshards`) and the merging ``validate`` job."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from diffpipe.config import ValidationConfig
from diffpipe.data.dataset.checks import PROBE_REASONS
from diffpipe.data.dataset.validate import probe_key

#: The kinds a shard listing gives table files (their format); media files have image / video.
TABLE_KINDS = ("parquet", "arrow")

#: One row per media file of the shard: its stat when probed and what probing found.
PROBE_SCHEMA = pa.schema(
    [
        ("dataset", pa.string()),
        ("relpath", pa.string()),
        ("size", pa.int64()),
        ("mtime_ns", pa.int64()),
        ("kind", pa.string()),
        ("sha256", pa.string()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("frames", pa.int32()),
        ("fps", pa.float64()),
        ("reasons", pa.list_(pa.string())),  # what probing found; a row with another reason
        # than PROBE_REASONS (``unreadable``) is probed again, never reused
        ("notes", pa.list_(pa.string())),
    ]
)


def read_probe_table(path: Path, key: str) -> pl.DataFrame | None:
    """A probe table as a DataFrame; None when absent, damaged, of another layout or another probe key."""
    got = read_probe(path, key)
    return None if got is None else got[0]


def read_probe_meta(path: Path, vcfg: ValidationConfig) -> tuple[pl.DataFrame, dict[bytes, bytes]] | None:
    """A probe table and its metadata (:func:`read_probe_table`), for the probe key of ``vcfg``."""
    return read_probe(path, probe_key(vcfg))


def read_probe(path: Path, key: str) -> tuple[pl.DataFrame, dict[bytes, bytes]] | None:
    """A probe table and its metadata; None when absent, damaged, of another layout or another probe key."""
    try:
        with pq.ParquetFile(path) as f:
            table = f.read()
    except Exception:  # a damaged table only costs the reuse
        return None
    meta = table.schema.metadata or {}
    if table.schema.remove_metadata() != PROBE_SCHEMA or meta.get(b"probe_key") != key.encode():
        return None
    return pl.from_arrow(table), meta


def reusable() -> pl.Expr:
    """A probe that stands for its file while unchanged: content hashed, only content reasons."""
    known = pl.lit(sorted(PROBE_REASONS), dtype=pl.List(pl.String))
    return pl.col("sha256").is_not_null() & (pl.col("reasons").list.set_difference(known).list.len() == 0)
