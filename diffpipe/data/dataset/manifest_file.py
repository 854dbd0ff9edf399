"""The validation manifest's Parquet file: its schema, reading it, and writing it only when its rows change
(so Snakemake sees an unchanged manifest as unchanged)."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from diffpipe.data.dataset.aux_images import ROLES as AUX_ROLES
from diffpipe.utils import atomic_path

_TOKENS = pa.list_(pa.struct([("encoder", pa.string()), ("tokens", pa.int32()), ("limit", pa.int32())]))
MANIFEST_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("dataset", pa.string()),
        ("path", pa.string()),
        ("relpath", pa.string()),
        ("kind", pa.string()),  # image | video
        ("sha256", pa.string()),
        ("size", pa.int64()),
        ("mtime_ns", pa.int64()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("frames", pa.int32()),
        ("fps", pa.float64()),  # measured from decoded frame times; null for images
        ("caption", pa.string()),  # the first alternative (what a single-caption reader uses)
        ("captions", pa.list_(pa.string())),  # every alternative
        ("caption_sha256", pa.string()),
        ("caption_file", pa.string()),  # relative path of the caption file, null when from metadata
        ("caption_size", pa.int64()),
        ("caption_mtime_ns", pa.int64()),
        ("tokens", _TOKENS),  # per encoder: most tokens over the alternatives, and the limit
        ("tokens_key", pa.string()),
        ("split", pa.string()),  # train | eval
        ("status", pa.string()),  # ok | warning | skipped | error
        ("reasons", pa.list_(pa.string())),
        ("notes", pa.list_(pa.string())),  # one human sentence per reason
        # per aux role (mask, control): absolute path, content hash, stat and size; null when none
        *[
            (f"{role}_{col}", typ)
            for role in AUX_ROLES
            for col, typ in (
                ("path", pa.string()),
                ("sha256", pa.string()),
                ("size", pa.int64()),
                ("mtime_ns", pa.int64()),
                ("width", pa.int32()),
                ("height", pa.int32()),
            )
        ],
    ]
)


def read_parquet(path: Path) -> pa.Table:
    """A Parquet file as one Arrow table."""
    # ParquetFile, not read_table: read_table imports pyarrow.dataset (over 0.5 s of a rerun).
    with pq.ParquetFile(path) as f:
        return f.read()


def write_manifest(path: Path, table: pa.Table) -> bool:
    """Write the manifest unless it holds the same rows; unchanged -> only touch it. (Validation writes a
    manifest it knows to differ a slice at a time instead: :func:`diffpipe.data.dataset.columnar.write_frame`.)"""
    if path.is_file():
        try:
            old = read_parquet(path)
            # Parquet renames list items ("element"), so compare the keys apart from the columns.
            same = old.equals(table) and old.schema.metadata == table.schema.metadata
        except Exception:
            same = False
        if same:
            os.utime(path)  # newer than its inputs for Snakemake, same content for its consumers
            return False
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
    return True
