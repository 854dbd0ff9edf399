"""The content-addressed cache store that cache jobs reuse entries from.

Layout under ``cache.dir`` (default ``<output_dir>/cache/store``)::

    latents/<name>.zarr            a finished latent shard (immutable)
    latents/<name>.index.parquet   key, array, row of every entry in it
    text/<name>.arrow              a finished text shard (immutable)
    text/<name>.index.parquet

``name`` is a hash of the shard's ``(id, key)`` pairs and dtype, so equal
shards get equal names and two runs (or two configs sharing a VAE) that
need the same entries find them here. A shard is renamed into place before
its index, and lookups read only indexes: a job killed at any moment leaves
at most a ``.tmp-*`` folder, never an entry a reader can take for finished.
A cache job looks up the keys of its spec, copies the rows found here (the
store shard's checksum is checked first), encodes only the missing ones,
writes the complete shard into the store, and hard-links it into the run's
output (a copy where links are impossible), so the store costs no extra disk.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from diffpipe.utils import atomic_path, digest

KINDS = {"latents": ".zarr", "text": ".arrow"}
INDEX_SUFFIX = ".index.parquet"
_INDEX_SCHEMA = pa.schema([("key", pa.string()), ("array", pa.string()), ("row", pa.int64())])


@dataclass(frozen=True)
class StoreRow:
    """Where a key's value lives: a store shard, the array in it ("" for text), the row."""

    shard: Path
    array: str
    row: int


def shard_content_name(kind: str, dtype: str, pairs: Iterable[tuple[str, str]]) -> str:
    """Store name of a shard holding ``(id, key)`` pairs: equal content, equal name."""
    return digest([kind, dtype, sorted(pairs)])[:32]


class Store:
    """A folder of finished shards plus one Parquet index per shard."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def shard_path(self, kind: str, name: str) -> Path:
        return self.root / kind / f"{name}{KINDS[kind]}"

    def index_path(self, kind: str, name: str) -> Path:
        return self.root / kind / f"{name}{INDEX_SUFFIX}"

    def has(self, kind: str, name: str) -> bool:
        return self.index_path(kind, name).is_file() and self.shard_path(kind, name).exists()

    def lookup(self, kind: str, keys: Iterable[str]) -> dict[str, StoreRow]:
        """Rows of the store that hold ``keys`` (keys absent from the store are left out).

        When several shards hold a key, the first by name wins, so every job
        resolves a key the same way.
        """
        wanted = set(keys)
        found: dict[str, StoreRow] = {}
        folder = self.root / kind
        if not wanted or not folder.is_dir():
            return found
        for index in sorted(folder.glob(f"*{INDEX_SUFFIX}")):
            name = index.name[: -len(INDEX_SUFFIX)]
            shard = self.shard_path(kind, name)
            if not shard.exists():
                continue
            try:
                table = pq.ParquetFile(index).read()
            except Exception:  # a damaged index only costs a re-encode
                continue
            for key, array, row in zip(
                table.column("key").to_pylist(),
                table.column("array").to_pylist(),
                table.column("row").to_pylist(),
                strict=True,
            ):
                if key in wanted and key not in found:
                    found[key] = StoreRow(shard, array, row)
            if len(found) == len(wanted):
                break
        return found

    def add_index(self, kind: str, name: str, rows: list[tuple[str, str, int]]) -> None:
        """Publish a finished shard: write its index (atomically, after the shard)."""
        table = pa.Table.from_pylist(
            [{"key": k, "array": a, "row": r} for k, a, r in rows], schema=_INDEX_SCHEMA
        )
        with atomic_path(self.index_path(kind, name)) as tmp:
            pq.write_table(table, tmp)

    def discard(self, kind: str, name: str) -> None:
        """Remove a shard found damaged: its index first, so no lookup points at it."""
        self.index_path(kind, name).unlink(missing_ok=True)
        path = self.shard_path(kind, name)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def prune(store: Store, kind: str) -> list[str]:
    """Remove store shards whose every key is also held by a kept shard; returns their names.

    A rebuilt run shard re-stores the rows it copied, so each rebuild leaves
    the previous store shard superseded. Removing one loses no entry, and
    run outputs are hard links with their own names, so they stay readable.
    Oldest shards go first.
    """
    folder = store.root / kind
    shards: list[tuple[float, str, set[str]]] = []
    for index in folder.glob(f"*{INDEX_SUFFIX}") if folder.is_dir() else []:
        name = index.name[: -len(INDEX_SUFFIX)]
        try:
            keys = set(pq.ParquetFile(index).read(columns=["key"]).column("key").to_pylist())
        except Exception:
            continue
        shards.append((index.stat().st_mtime, name, keys))
    holders: dict[str, int] = {}
    for _, _, keys in shards:
        for k in keys:
            holders[k] = holders.get(k, 0) + 1
    removed = []
    for _, name, keys in sorted(shards):
        if keys and all(holders[k] > 1 for k in keys):
            store.discard(kind, name)
            for k in keys:
                holders[k] -= 1
            removed.append(name)
    return removed


def clean_stale_temp(target: str | Path, older_than: float = 0.0) -> None:
    """Remove ``.tmp-<name>-*`` leftovers of a killed writer of ``target``.

    With ``older_than=0`` call it only where one job owns ``target``
    (Snakemake runs one job per output), so the leftover cannot belong to a
    live writer; in the shared store pass an age in seconds instead.
    """
    target = Path(target)
    if target.parent.is_dir():
        now = time.time()
        for tmp in target.parent.glob(f".tmp-{target.name}-*"):
            try:
                if now - tmp.stat().st_mtime >= older_than:
                    shutil.rmtree(tmp, ignore_errors=True)
            except OSError:
                continue


def link_into_place(src: str | Path, target: str | Path) -> None:
    """Make ``target`` an atomic hard-linked copy of ``src`` (file or folder)."""
    src, target = Path(src), Path(target)
    is_dir = src.is_dir()
    clean_stale_temp(target)
    with atomic_path(target, is_dir=is_dir) as tmp:
        if not is_dir:
            _link_or_copy(src, tmp)
            return
        for path in sorted(src.rglob("*")):
            dest = tmp / path.relative_to(src)
            if path.is_dir():
                dest.mkdir(parents=True, exist_ok=True)
            else:
                dest.parent.mkdir(parents=True, exist_ok=True)
                _link_or_copy(path, dest)


def _link_or_copy(src: Path, dest: Path) -> None:
    try:
        os.link(src, dest)
    except OSError:  # another file system, or links not supported
        shutil.copy2(src, dest)
