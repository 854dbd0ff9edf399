"""Small shared helpers: atomic and durable writes, content hashing, stable JSON."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
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


def stat_stamp(path: str | os.PathLike) -> tuple[int, int]:
    """A file's (size, mtime_ns): what a memo of its content is keyed on (raises ``OSError`` as ``os.stat``)."""
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def stable_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace variance: equal data, equal text."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def read_json_object(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON object ``path`` holds. Raises :class:`ValueError` naming the file when it cannot be read, is not
    JSON or holds something other than an object (callers add what the file should have been)."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} cannot be read as JSON ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds no JSON object (a {type(value).__name__})")
    return value


def digest(obj: Any) -> str:
    """Content hash of any JSON-serialisable value (used for cache keys)."""
    return sha256_bytes(stable_json(obj).encode())


#: The file diffpipe writes into every folder it creates (and into output folders it
#: writes files into), recording what it wrote there: each entry's kind, and a file's
#: size and modification time as written. An entry is diffpipe's to replace only while
#: it still matches its record, so a user's file under a recorded name, a file changed
#: since, or a marker copied into another folder proves nothing.
OUTPUT_MARKER = ".diffpipe-output.json"
_MARKER_FORMAT = 2  # 1 (before #38): names only, which a copied marker could fake
#: The empty file Snakemake writes into every directory() output after its job.
SNAKEMAKE_STAMP = ".snakemake_timestamp"
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
    """Relative POSIX paths of everything under ``folder`` (files, folders, links), its marker aside."""
    out = set()
    for root, dirs, files in os.walk(folder):
        rel = Path(root).relative_to(folder)
        out.update((rel / name).as_posix() for name in dirs + files)
    return out - {OUTPUT_MARKER}


def _stamp(path: Path) -> dict[str, Any] | None:
    """What shows an entry is still the one written: its kind, a file's (or link's) size and mtime.

    None when it is gone (nothing there to lose). A folder's content is stamped entry by entry.
    """
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None
    if stat.S_ISDIR(st.st_mode):
        return {"kind": "dir"}
    return {"kind": "link" if stat.S_ISLNK(st.st_mode) else "file", "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def read_marker(folder: str | os.PathLike) -> dict[str, Any] | None:
    """``folder``'s :data:`OUTPUT_MARKER`; None when missing, damaged, or of an earlier format (proving nothing)."""
    try:
        data = json.loads((Path(folder) / OUTPUT_MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(data, dict) and data.get("written_by") == "diffpipe" and data.get("format") == _MARKER_FORMAT
            and isinstance(data.get("entries"), dict)):
        return None
    return data


def _marker_json(entries: dict[str, Any], base: dict[str, Any] | None = None) -> str:
    note = ("diffpipe wrote these entries here; a later diffpipe may replace an entry while its kind, size "
            "and modification time are as recorded, and nothing else")
    data = {**(base or {}), "written_by": "diffpipe", "format": _MARKER_FORMAT, "note": note,
            "entries": dict(sorted(entries.items()))}
    return json.dumps(data, indent=1) + "\n"


def write_marker(folder: str | os.PathLike, entries: dict[str, Any], base: dict[str, Any] | None = None,
                 *, durable: bool = True) -> None:
    """Write ``folder``'s marker, atomically: ``entries`` (relative path -> stamp; None: claimed, not yet
    written) and the other fields of ``base`` (the marker it replaces)."""
    write_text_atomic(Path(folder) / OUTPUT_MARKER, _marker_json(entries, base), durable=durable)


def foreign_entries(folder: str | os.PathLike) -> list[str]:
    """What under ``folder`` diffpipe cannot prove it wrote: ``[]`` when replacing ``folder`` loses nothing.

    An entry is proven by its record in the folder's marker (its stamp unchanged).
    Snakemake's :data:`SNAKEMAKE_STAMP` counts as no one's data only empty, at the
    top of a folder with a marker; a user's file of that name is kept. Files come
    first, then folders (a user's folder lists as itself and each file in it).
    """
    folder = Path(folder)
    marker = read_marker(folder)
    recorded = marker["entries"] if marker else {}
    out = []
    for rel in _entries(folder):
        now = _stamp(folder / rel)
        if now is None or recorded.get(rel) == now:
            continue
        if rel == SNAKEMAKE_STAMP and marker and now["kind"] == "file" and now["size"] == 0:
            continue
        out.append(rel)
    return sorted(out, key=lambda rel: ((folder / rel).is_dir(), rel))


def _examples(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


#: How a refusal ends: why a recorded name may not be enough.
_RECORD_NOTE = (f"(diffpipe records what it writes, with each file's size and modification time, in {OUTPUT_MARKER}: "
                "a file changed since, a record copied from another folder, or an output of a diffpipe from before "
                "that record is not proven to be diffpipe's; delete it yourself if it is.)")


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
    foreign = foreign_entries(target)
    if foreign:
        raise NotOurFolderError(
            f"{target} holds files diffpipe did not write ({_examples(foreign)}); diffpipe never replaces "
            f"such a folder. Choose a new or empty folder, or move those files away. {_RECORD_NOTE}")


def _holds_user_data(path: Path, recorded: dict[str, Any] | None) -> bool:
    """Would writing ``path`` lose something? A file unless as recorded; a folder unless empty or all diffpipe's.

    (Snakemake creates the folders of a job's outputs before it runs: those are empty.)
    """
    if path.is_dir() and not path.is_symlink():
        return bool(foreign_entries(path))
    now = _stamp(path)
    return now is not None and now != recorded


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
    --out``, ``demo-data``): a name that exists there and is not, as recorded in
    the folder's marker, the file diffpipe wrote (a user's file, or one edited
    since) raises :class:`NotOurFolderError` before anything is written; every
    other file in the folder stays as it is. The names are claimed in the marker,
    and each write under one (:func:`atomic_path`) records what it wrote.
    """
    folder, names = Path(folder), set(names)
    if folder.exists() and not folder.is_dir():
        raise NotOurFolderError(f"{folder} is a file, not a folder; choose a new or empty folder.")
    folder.mkdir(parents=True, exist_ok=True)
    marker = read_marker(folder)
    if marker is None and (folder / OUTPUT_MARKER).exists() and not _is_diffpipe_json(folder):
        raise NotOurFolderError(f"{folder / OUTPUT_MARKER} is not diffpipe's record (the name diffpipe keeps its "
                                "record under); move it away or choose another folder.")
    recorded = dict(marker["entries"]) if marker else {}
    clash = sorted(n for n in names if _holds_user_data(folder / n, recorded.get(n)))
    if clash:
        raise NotOurFolderError(
            f"{folder} already holds {_examples(clash)}, which diffpipe did not write (or which changed since); "
            f"diffpipe never overwrites a user's file. Choose a new or empty folder, or move those files away. "
            f"{_RECORD_NOTE}")
    claimed = {**recorded, **{n: recorded.get(n) for n in names}}
    if marker is None or claimed != recorded:
        write_marker(folder, claimed, marker)
    return folder


def record_files(folder: str | os.PathLike, rels: Iterable[str], *, durable: bool = True) -> None:
    """Record in ``folder``'s marker that the files ``rels`` (relative paths, as they are now) are
    diffpipe's, and the folders they are in: for an output folder diffpipe fills file by file (the
    plan's). The marker then lists exactly these; anything else in ``folder`` stays unproven."""
    folder, entries = Path(folder), {}
    for rel in map(PurePosixPath, rels):
        entries |= {parent.as_posix(): {"kind": "dir"} for parent in list(rel.parents)[:-1]}
        entries[rel.as_posix()] = _stamp(folder / rel)
    marker = read_marker(folder)
    if marker is None or marker["entries"] != entries:
        write_marker(folder, entries, marker, durable=durable)


def _is_diffpipe_json(folder: Path) -> bool:
    """Is ``folder``'s marker one diffpipe wrote, of any format (an earlier one may be replaced)?"""
    try:
        data = json.loads((folder / OUTPUT_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("written_by") == "diffpipe"


def _record_written(target: Path, durable: bool) -> None:
    """After diffpipe wrote ``target``: record its stamp where its folder's marker claims the name."""
    if target.name == OUTPUT_MARKER:
        return
    marker = read_marker(target.parent)
    if marker is None or target.name not in marker["entries"]:
        return
    entries = {**marker["entries"], target.name: _stamp(target)}
    if entries != marker["entries"]:
        write_marker(target.parent, entries, marker, durable=durable)


@contextmanager
def atomic_path(target: str | os.PathLike, *, is_dir: bool = False, durable: bool = True) -> Iterator[Path]:
    """Yield a temporary sibling path; rename it onto ``target`` only on success.

    A process killed inside the block leaves at most a ``.tmp-*`` sibling,
    never a half-written ``target``. With ``durable`` (the default) the content
    is synced before the rename and the folder after it, so a power loss
    leaves the old ``target`` or the complete new one, never an empty file.

    A folder (``is_dir``) gets the :data:`OUTPUT_MARKER` recording what it holds.
    An existing ``target`` folder is replaced only when it is empty or holds
    nothing but what diffpipe wrote there, unchanged; any other folder, a file where a
    folder goes, or a folder where a file goes raises :class:`NotOurFolderError`
    (checked on entry, before the work, and again before the rename). A ``target``
    whose name the parent's marker claims (:func:`claim_files`) is recorded there.
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
        if is_dir:  # stamped before the rename, which changes no file's size or time
            (inner / OUTPUT_MARKER).write_text(_marker_json({rel: _stamp(inner / rel) for rel in _entries(inner)}))
        if durable:
            _sync_under(inner) if is_dir else fsync_file(inner)
        if target.exists() or target.is_symlink():
            check_replaceable(target, is_dir=is_dir)
            if is_dir:  # set the old folder aside (removed with the temp folder), then rename
                os.replace(target, tmp / f".old-{target.name}")
        os.replace(inner, target)
        _record_written(target, durable)
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
