"""Small shared helpers: atomic and durable writes, content hashing, stable JSON."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HASH_NAME = "sha256"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's content, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def stable_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace variance: equal data, equal text."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def digest(obj: Any) -> str:
    """Content hash of any JSON-serialisable value (used for cache keys)."""
    return sha256_bytes(stable_json(obj).encode())


#: The file diffpipe writes into every folder it creates (and into output folders it
#: writes files into), listing what it wrote there: the proof that a later run may
#: replace that folder or those files without losing anything of the user's.
OUTPUT_MARKER = ".diffpipe-output.json"
#: Entries that are no one's data: Snakemake stamps every directory output with this file.
_IGNORED = {OUTPUT_MARKER, ".snakemake_timestamp"}
_SHOWN = 5


class NotOurFolderError(ValueError):
    """An output path holds something diffpipe did not write: it is never replaced."""


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a file's content to the disk (``fsync``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a folder's entries (names created, renamed or removed in it) to the disk.

    File systems that cannot sync a folder (``EINVAL``, as some network ones
    answer) are skipped: there the rename's own guarantees are all there is.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike, *, missing_ok: bool = False) -> None:
    """Sync every file and folder under ``path`` (``path`` itself too), then ``path``'s parent.

    After it, ``path`` and all it holds survive a power loss. Children are
    synced before their folder, the parent last (it holds ``path``'s entry).
    ``missing_ok``: another process may still be writing there (the ranks of one
    checkpoint); a file gone by the time it would be synced is skipped, since
    its writer syncs what it renamed it to.
    """
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        _sync_under(path, missing_ok)
    else:
        fsync_file(path)
    fsync_dir(path.parent)


def _sync_under(folder: Path, missing_ok: bool = False) -> None:
    for root, _dirs, files in os.walk(folder, topdown=False):
        # With missing_ok, a file or a whole temporary folder another writer renamed away is skipped.
        for path, sync in [(os.path.join(root, n), fsync_file) for n in files] + [(root, fsync_dir)]:
            if os.path.islink(path):
                continue
            try:
                sync(path)
            except FileNotFoundError:
                if not missing_ok:
                    raise


def _entries(folder: Path) -> set[str]:
    """Relative POSIX paths of everything under ``folder`` (files, folders, links), the marker aside."""
    out = set()
    for root, dirs, files in os.walk(folder):
        rel = Path(root).relative_to(folder)
        out.update((rel / name).as_posix() for name in dirs + files)
    return out - _IGNORED


def _marker_entries(folder: Path) -> set[str]:
    """What diffpipe recorded writing into ``folder`` (nothing when there is no readable marker)."""
    try:
        data = json.loads((folder / OUTPUT_MARKER).read_text())
        return {str(e) for e in data["entries"]} if data.get("written_by") == "diffpipe" else set()
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return set()


def _marker_text(entries: set[str]) -> str:
    note = "diffpipe wrote these entries here; a later diffpipe run may replace them (and only them)"
    return json.dumps({"written_by": "diffpipe", "note": note, "entries": sorted(entries)}, indent=1) + "\n"


def _examples(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def check_replaceable(target: str | os.PathLike, *, is_dir: bool = False) -> None:
    """Raise :class:`NotOurFolderError` unless writing ``target`` (a folder when ``is_dir``) loses nothing of
    the user's. :func:`atomic_path` checks it; call it early where the work before the write is long."""
    target = Path(target)
    if not (target.exists() or target.is_symlink()):
        return
    if not is_dir:
        if target.is_dir() and not target.is_symlink():
            raise NotOurFolderError(f"{target} is a folder; diffpipe writes a file there and never replaces "
                                    "a folder with one. Move the folder away or choose another path.")
        return
    if target.is_symlink() or not target.is_dir():
        kind = "a symbolic link" if target.is_symlink() else "a file"
        raise NotOurFolderError(f"{target} is {kind}, not a folder; diffpipe writes a folder there and never "
                                "replaces a file with one. Choose a new or empty folder.")
    foreign = sorted(_entries(target) - _marker_entries(target))
    if foreign:
        raise NotOurFolderError(
            f"{target} holds files diffpipe did not write ({_examples(foreign)}); diffpipe never replaces "
            f"such a folder. Choose a new or empty folder, or move those files away. (diffpipe lists what it "
            f"writes in {OUTPUT_MARKER}; an output of a diffpipe from before that marker has none: delete it "
            "if it is one.)")


def _holds_user_data(path: Path) -> bool:
    """Would writing ``path`` lose something? A file does; a folder unless empty or all diffpipe's.

    (Snakemake creates the folders of a job's outputs before it runs: those are empty.)
    """
    if path.is_dir() and not path.is_symlink():
        return bool(_entries(path) - _marker_entries(path))
    return path.exists() or path.is_symlink()


def _make_parents(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; return the folders whose entries changed."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    if missing:
        missing[0].mkdir(parents=True, exist_ok=True)
    return [m.parent for m in missing]


def claim_files(folder: str | os.PathLike, names: Iterable[str]) -> Path:
    """Make ``folder`` ready to receive diffpipe's files ``names`` without touching a user's.

    For writers that put several outputs into a folder a user may name (``export
    --out``): a name that exists there but was not written by diffpipe raises
    :class:`NotOurFolderError` before anything is written; every other file in
    the folder stays as it is. The names are recorded in the folder's marker.
    """
    folder, names = Path(folder), set(names)
    if folder.exists() and not folder.is_dir():
        raise NotOurFolderError(f"{folder} is a file, not a folder; choose a new or empty folder.")
    folder.mkdir(parents=True, exist_ok=True)
    ours = _marker_entries(folder)
    clash = sorted(n for n in names - ours if _holds_user_data(folder / n))
    if clash:
        raise NotOurFolderError(
            f"{folder} already holds {_examples(clash)}, which diffpipe did not write; diffpipe never "
            "overwrites a user's file. Choose a new or empty folder, or move those files away.")
    if not names <= ours:
        write_text_atomic(folder / OUTPUT_MARKER, _marker_text(ours | names))
    return folder


def _write_marker(folder: Path, entries: set[str]) -> None:
    (folder / OUTPUT_MARKER).write_text(_marker_text(entries))


@contextmanager
def atomic_path(target: str | os.PathLike, *, is_dir: bool = False, durable: bool = True) -> Iterator[Path]:
    """Yield a temporary sibling path; rename it onto ``target`` only on success.

    A process killed inside the block leaves at most a ``.tmp-*`` sibling,
    never a half-written ``target``. With ``durable`` (the default) the content
    is synced before the rename and the folder after it, so a power loss
    leaves the old ``target`` or the complete new one, never an empty file.

    A folder (``is_dir``) gets the :data:`OUTPUT_MARKER` listing what it holds.
    An existing ``target`` folder is replaced only when it is empty or holds
    nothing but what diffpipe wrote there; any other folder, a file where a
    folder goes, or a folder where a file goes raises :class:`NotOurFolderError`
    (checked on entry, before the work, and again before the rename).
    """
    target = Path(target)
    check_replaceable(target, is_dir=is_dir)
    created = _make_parents(target.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    inner = tmp / target.name
    if is_dir:
        inner.mkdir()
    try:
        yield inner
        if is_dir:
            _write_marker(inner, _entries(inner))
        if durable:
            _sync_under(inner) if is_dir else fsync_file(inner)
        if target.exists() or target.is_symlink():
            check_replaceable(target, is_dir=is_dir)
            if is_dir:  # set the old folder aside (removed with the temp folder), then rename
                os.replace(target, tmp / f".old-{target.name}")
        os.replace(inner, target)
        if durable:
            for folder in [target.parent, *created]:
                fsync_dir(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_bytes_atomic(path: str | os.PathLike, data: bytes, *, durable: bool = True) -> None:
    with atomic_path(path, durable=durable) as tmp:
        tmp.write_bytes(data)


def write_text_atomic(path: str | os.PathLike, text: str, *, durable: bool = True) -> None:
    write_bytes_atomic(path, text.encode(), durable=durable)


def write_if_changed(path: str | os.PathLike, data: bytes | str) -> bool:
    """Atomically write ``data`` unless the file already holds exactly it.

    Returns True when the file was (re)written. Unchanged files keep their
    mtime, so Snakemake sees no update and downstream jobs do not rerun.
    """
    if isinstance(data, str):
        data = data.encode()
    path = Path(path)
    if path.is_file() and path.read_bytes() == data:
        return False
    write_bytes_atomic(path, data)
    return True
