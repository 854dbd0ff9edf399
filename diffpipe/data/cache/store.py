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

Several jobs (of one run or of several runs sharing ``cache.dir``) use a store
at once, so ``.lock`` in its root orders them (``flock``): a job reads store
shards under a shared lock; publishing a shard (write, index, link into the
run) and every removal (a damaged shard's discard, ``prune``) take the
exclusive lock. No shard is removed or replaced while another job reads it,
and under the exclusive lock every ``.tmp-*`` folder in the store is a killed
writer's. The lock needs a file system whose ``flock`` works across the
machines that share it (local disks do; NFS v4 does on Linux).
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from diffpipe.utils import atomic_path, digest

KINDS = {"latents": ".zarr", "text": ".arrow"}
INDEX_SUFFIX = ".index.parquet"
LOCK_NAME = ".lock"
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

    @contextmanager
    def lock(self, *, exclusive: bool = False, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
        """Hold the store's lock: shared to read shards, exclusive to add or remove them.

        ``on_wait`` is called once when the lock is busy, before waiting for it.
        Locks are per open file: do not nest two ``lock`` blocks in one process.
        """
        fd = self._open_lock()
        try:
            mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
            except BlockingIOError:
                if on_wait is not None:
                    on_wait()
                fcntl.flock(fd, mode)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _open_lock(self) -> int:
        path = self.root / LOCK_NAME
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            try:
                return os.open(path, os.O_RDONLY)  # a store this user may only read: flock works all the same
            except OSError as err:
                raise ValueError(f"cache store {self.root}: cannot open or create its lock file {path}: "
                                 f"{err.strerror}; make the folder writable (or create the file once)") from err

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
        """Publish a finished shard: write its index (atomically, after the shard).

        Call it under the exclusive lock (:meth:`publish` does)."""
        table = pa.Table.from_pylist(
            [{"key": k, "array": a, "row": r} for k, a, r in rows], schema=_INDEX_SCHEMA
        )
        with atomic_path(self.index_path(kind, name)) as tmp:
            pq.write_table(table, tmp)

    def publish(
        self,
        kind: str,
        name: str,
        out_path: str | Path,
        write: Callable[[Path], object],
        rows: list[tuple[str, str, int]],
        *,
        rewrite: bool = False,
        damaged: Iterable[str] = (),
    ) -> Path:
        """Under the exclusive lock: store shard ``name`` and hard-link it to ``out_path``.

        ``write(path)`` writes the shard when the store lacks it (or ``rewrite``),
        then its index goes in. ``damaged`` names shards this job found failing
        their checksum; they are removed here, where no other job reads them.
        """
        target = self.shard_path(kind, name)
        with self.lock(exclusive=True):
            for bad in damaged:
                self._remove(kind, bad)
            clean_stale_temp(target)  # no writer is live under the exclusive lock
            if rewrite or not self.has(kind, name):
                self._remove(kind, name)  # a copy without index, or one being rewritten
                write(target)
                self.add_index(kind, name, rows)
            link_into_place(target, out_path)
        return target

    def discard(self, kind: str, name: str) -> None:
        """Remove a shard found damaged (waits until no job reads the store)."""
        with self.lock(exclusive=True):
            self._remove(kind, name)

    def _remove(self, kind: str, name: str) -> None:
        # The index first, so no lookup points at a half-removed shard.
        self.index_path(kind, name).unlink(missing_ok=True)
        path = self.shard_path(kind, name)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def prune(store: Store, kind: str, *, on_wait: Callable[[], None] | None = None) -> list[str]:
    """Remove store shards whose every key is also held by a kept shard; returns their names.

    A rebuilt run shard re-stores the rows it copied, so each rebuild leaves
    the previous store shard superseded. Removing one loses no entry, and
    run outputs are hard links with their own names, so they stay readable.
    Oldest shards go first. Leftovers of killed writers (``.tmp-*`` folders,
    shards without an index) go too. Runs under the exclusive lock: it waits
    for jobs reading the store (``on_wait`` is called if it must).
    """
    folder = store.root / kind
    with store.lock(exclusive=True, on_wait=on_wait):
        if not folder.is_dir():
            return []
        indexed = set()
        shards: list[tuple[float, str, set[str]]] = []
        for index in folder.glob(f"*{INDEX_SUFFIX}"):
            name = index.name[: -len(INDEX_SUFFIX)]
            indexed.add(name)
            try:
                keys = set(pq.ParquetFile(index).read(columns=["key"]).column("key").to_pylist())
            except Exception:
                continue
            shards.append((index.stat().st_mtime, name, keys))
        for path in folder.iterdir():
            if path.name.startswith(".tmp-"):
                shutil.rmtree(path, ignore_errors=True)
            elif path.name.endswith(KINDS[kind]) and path.name.removesuffix(KINDS[kind]) not in indexed:
                store._remove(kind, path.name.removesuffix(KINDS[kind]))  # renamed in, killed before its index
        holders: dict[str, int] = {}
        for _, _, keys in shards:
            for k in keys:
                holders[k] = holders.get(k, 0) + 1
        removed = []
        for _, name, keys in sorted(shards):
            if keys and all(holders[k] > 1 for k in keys):
                store._remove(kind, name)
                for k in keys:
                    holders[k] -= 1
                removed.append(name)
    return removed


def clean_stale_temp(target: str | Path) -> None:
    """Remove ``.tmp-<name>-*`` leftovers of a killed writer of ``target``.

    Call it only where no other writer of ``target`` can be live: where one
    job owns ``target`` (Snakemake runs one job per output), or in the store
    under its exclusive lock.
    """
    target = Path(target)
    if target.parent.is_dir():
        for tmp in target.parent.glob(f".tmp-{target.name}-*"):
            shutil.rmtree(tmp, ignore_errors=True)


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
