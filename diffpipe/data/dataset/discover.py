"""Find a dataset's media, caption and metadata files, and the entries that are not files.

Snakemake calls :func:`dataset_files` while building its DAG (the validate
rule's inputs), so the walk uses ``os.scandir`` (one syscall per folder, file
types from the directory entry) and never raises. Hidden (dot) files are
left out. What cannot be a usable file is returned as a problem instead of
being dropped silently: broken symlinks, symlink loops, names that are not
valid text, unreadable folders. Those never reach Snakemake's input list.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from diffpipe.config import DatasetConfig, ValidationConfig
from diffpipe.data.dataset import hub
from diffpipe.data.dataset.metadata import DEFAULT_NAMES
from diffpipe.data.dataset.tables import TableError, Tables, find_tables
from diffpipe.utils import digest


@dataclass(frozen=True)
class Found:
    """A walk problem: relative path (printable), reason code, sentence."""

    rel: str
    reason: str
    note: str


@dataclass
class Listing:
    """Files of one dataset, as POSIX paths relative to its root."""

    root: Path
    media: dict[str, str]  # relative path -> "image" | "video" (by extension)
    captions: list[str]
    root_ok: bool
    metadata: list[str] = field(default_factory=list)
    problems: list[Found] = field(default_factory=list)
    #: (size, mtime_ns) of media and caption files, when listed ``with_stats``; aux
    #: images by their absolute path.
    stats: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: Per auxiliary role with a folder (``mask_path``, ``control_path``): media stem
    #: (relative path without extension) -> the aux image's absolute path.
    aux: dict[str, dict[str, str]] = field(default_factory=dict)
    #: The aux folders that exist (role -> absolute folder).
    aux_roots: dict[str, Path] = field(default_factory=dict)
    #: A table dataset (``datasets`` folder, Parquet shards, hub snapshot): its files; media is empty.
    table: Tables | None = None
    #: Why the dataset cannot be read at all: (reason code, sentence); a hub id not found, a table
    #: split missing.
    error: tuple[str, str] | None = None
    #: Where the dataset's symbolic links may lead: the root, or for a hub snapshot its repository
    #: folder (the snapshot's files are links into ``blobs/``).
    link_root: Path | None = None
    #: Media files the walk handed to its ``batch`` callback (:func:`list_dataset`), not kept in ``media``.
    handed: int = 0


#: A walk's ``batch`` callback: the media, captions and stats found since the last call (the walk keeps none).
Batch = Callable[[dict[str, str], list[str], dict[str, tuple[int, int]]], None]
#: Media and caption files a walk holds before it hands them to its ``batch`` callback.
BATCH_FILES = 65_536


def norm_ext(ext: str) -> str:
    ext = ext.lower()
    return ext if ext.startswith(".") else f".{ext}"


def printable(name: str) -> str:
    """A file name as text: undecodable bytes as ``\\xNN``, control characters escaped."""
    raw = os.fsencode(name).decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in raw)


_BAD_FILE = "the file name is not valid UTF-8 text or holds control characters; rename it"
_BAD_DIR = "the folder name is not valid UTF-8 text or holds control characters; nothing in it is read; rename it"


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def _bad_name(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes come back as lone surrogates
        return True
    return not name.isprintable()


def _walk(
    root: str,
    kinds: dict[str, str],
    cap_ext: str,
    meta_names: set[str] | None,
    with_stats: bool,
    skip: frozenset[str] = frozenset(),
    exclude: tuple[str, ...] = (),
    batch: Batch | None = None,
) -> Listing:
    """The files under ``root``; with ``batch``, the media and captions go to it :data:`BATCH_FILES` at a time
    (in no order) instead of into the listing."""
    found = Listing(Path(root), {}, [], True)
    seen_dirs: set[tuple[int, int]] = set()
    stack = [("", root, os.path.realpath(root))]
    while stack:
        rel, folder, real = stack.pop()
        for entry in _scan(rel, folder, seen_dirs, found.problems):
            name = entry.name
            if name.startswith("."):  # hidden files, .DS_Store, editor swap files
                continue
            sub = f"{rel}{name}"
            if sub in skip:  # an aux folder (masks, controls) inside the dataset folder
                continue
            if _bad_name(name):
                found.problems.append(Found(printable(sub), "bad_filename", _BAD_DIR if _is_dir(entry) else _BAD_FILE))
                continue
            step = _follow(entry, sub, real, exclude, found.problems)
            if isinstance(step, tuple):
                stack.append(step)
            elif step:
                _sort_file(found, entry, sub, kinds, cap_ext, meta_names, with_stats)
                if batch and len(found.media) + len(found.captions) >= BATCH_FILES:
                    _hand(found, batch)
    if batch:
        _hand(found, batch)
    return Listing(
        Path(root),
        dict(sorted(found.media.items())),
        sorted(found.captions),
        True,
        sorted(found.metadata),
        found.problems,
        found.stats,
        handed=found.handed,
    )


def _hand(found: Listing, batch: Batch) -> None:
    """Hand the media and captions found so far to ``batch`` and forget them."""
    batch(found.media, found.captions, found.stats)
    found.handed += len(found.media)
    found.media, found.captions, found.stats = {}, [], {}


def _scan(rel: str, folder: str, seen_dirs: set[tuple[int, int]], problems: list[Found]) -> Iterator[os.DirEntry]:
    """A folder's entries, one at a time (a flat folder of a million files is never a list of a million
    entries); none when it was listed already (two links to one folder) or cannot be listed (a problem)."""
    try:
        st = os.stat(folder)
        if (st.st_dev, st.st_ino) in seen_dirs:  # two links to one folder: list it once
            return
        seen_dirs.add((st.st_dev, st.st_ino))
        with os.scandir(folder) as entries:
            yield from entries
    except OSError as err:
        problems.append(Found(rel.rstrip("/") or ".", "unreadable", f"cannot list the folder: {err.strerror}"))


def _follow(
    entry: os.DirEntry, sub: str, real: str, exclude: tuple[str, ...], problems: list[Found]
) -> tuple[str, str, str] | bool:
    """What the walk does with one entry: a folder to list ``(rel, path, real path)``, True for a file to sort,
    False to pass over (what the user should know of is a problem)."""
    try:
        if entry.is_symlink():
            return _follow_link(entry, sub, real, exclude, problems)
        if entry.is_dir():
            return sub + "/", entry.path, os.path.join(real, entry.name)
        return entry.is_file()
    except OSError:
        return False


def _follow_link(
    entry: os.DirEntry, sub: str, real: str, exclude: tuple[str, ...], problems: list[Found]
) -> tuple[str, str, str] | bool:
    """:func:`_follow` for a symbolic link: broken links, loops and links into the run's folders are problems."""
    try:
        os.stat(entry.path)
    except OSError as err:
        if err.errno == errno.ELOOP:
            problems.append(Found(sub, "symlink_loop", "the symbolic link points to itself"))
        else:
            dest = os.readlink(entry.path)
            problems.append(Found(sub, "broken_symlink", f"the symbolic link points to {dest}, which does not exist"))
        return False
    if not os.path.isdir(entry.path):
        return entry.is_file()
    target_real = os.path.realpath(entry.path)
    if real == target_real or real.startswith(target_real.rstrip("/") + "/"):
        problems.append(Found(sub, "symlink_loop", f"the symbolic link points to {target_real}, a folder above it"))
        return False
    if any(_within(target_real, folder) for folder in exclude):
        problems.append(Found(sub, "run_folder", f"the symbolic link points to {target_real}, a folder the run writes"))
        return False
    return sub + "/", entry.path, target_real


def _sort_file(
    found: Listing,
    entry: os.DirEntry,
    sub: str,
    kinds: dict[str, str],
    cap_ext: str,
    meta_names: set[str] | None,
    with_stats: bool,
) -> None:
    """File a regular file under media (by extension), captions or metadata (anything else is left out)."""
    ext = os.path.splitext(entry.name)[1].lower()
    if ext in kinds:
        found.media[sub] = kinds[ext]
    elif ext == cap_ext:
        found.captions.append(sub)
    else:
        if sub in meta_names if meta_names is not None else entry.name in DEFAULT_NAMES:
            found.metadata.append(sub)
        return
    if with_stats:  # the entry's stat: no path lookup from the root again
        try:
            st = entry.stat()
            found.stats[sub] = (st.st_size, st.st_mtime_ns)
        except OSError:
            pass


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def run_folders(*folders: str | os.PathLike | None) -> tuple[str, ...]:
    """The folders a run writes (``output_dir``, ``cache.dir``), resolved: never listed as data."""
    return tuple(os.path.realpath(f) for f in folders if f)


def aux_folders(ds: DatasetConfig) -> dict[str, Path]:
    """The configured aux image folders: role (``mask``, ``control``, ``control2``, ...) -> absolute folder."""
    return {role: Path(folder).absolute() for role in ds.aux_roles() if (folder := ds.aux_source(role)[0])}


def _aux_files(
    folder: Path, image_exts: list[str], with_stats: bool, listing: Listing, exclude: tuple[str, ...] = ()
) -> dict[str, str]:
    """Media stem -> absolute path of the images in an aux folder (first extension wins)."""
    exts = [norm_ext(e) for e in image_exts]
    found = _walk(str(folder), dict.fromkeys(exts, "image"), "\0", set(), with_stats, exclude=exclude)
    listing.problems += [Found(str(folder / p.rel), p.reason, p.note) for p in found.problems]
    order = {e: i for i, e in enumerate(exts)}
    files: dict[str, str] = {}
    for rel in sorted(found.media, key=lambda r: order[os.path.splitext(r)[1].lower()]):
        path = os.path.join(str(folder), rel)
        files.setdefault(os.path.splitext(rel)[0], path)
        if rel in found.stats:
            listing.stats[path] = found.stats[rel]
    return files


def list_dataset(
    ds: DatasetConfig,
    vcfg: ValidationConfig,
    *,
    with_stats: bool = False,
    exclude: tuple[str, ...] = (),
    batch: Batch | None = None,
) -> Listing:
    """Media, caption and metadata files of ``ds`` (recursive, sorted, hidden files skipped).

    Aux image folders (``mask_path``, ``control_path``) are listed into
    ``Listing.aux``; one inside the dataset folder is left out of its media.
    ``exclude``: the run's own folders (:func:`run_folders`); a symbolic link into one
    is reported as ``run_folder`` and not followed (the config refuses direct overlaps).
    ``batch``: takes the dataset folder's media and caption files (and their stats) a batch at a time, so
    the listing never holds them all as Python objects (validation keeps them as columns); ``media``,
    ``captions`` and ``stats`` then hold only the aux folders' files (``stats`` by absolute path).
    """
    root, error = dataset_root(ds)
    if error:
        return Listing(root, {}, [], False, error=error)
    if os.path.isdir(root):
        try:  # a folder saved by the datasets library: no walk needed
            if table := find_tables(root, ds.split, parquet=False):
                return _table_listing(root, table, with_stats)
        except TableError as err:
            return Listing(root, {}, [], False, error=("bad_metadata", str(err)))
    kinds = {norm_ext(e): "video" for e in vcfg.video_exts}
    kinds.update({norm_ext(e): "image" for e in vcfg.image_exts})
    # A configured metadata file by its path; else the default names in any folder
    # (imagefolder puts one in each split folder).
    meta_names = {ds.metadata.removeprefix("./")} if ds.metadata else None
    if not os.path.isdir(root):  # never raises (a name too long, a NUL: not a folder)
        return Listing(root, {}, [], False)
    folders = aux_folders(ds)
    skip = set()
    for folder in folders.values():
        try:
            skip.add(folder.relative_to(root).as_posix())
        except ValueError:
            pass
    listing = _walk(str(root), kinds, norm_ext(ds.caption_ext), meta_names, with_stats, frozenset(skip), exclude,
                    batch)
    if not listing.media and not listing.handed and not listing.metadata:  # Parquet shards holding the media bytes
        try:
            if table := find_tables(root, ds.split, parquet=True):
                return _table_listing(root, table, with_stats)
        except TableError as err:
            return Listing(root, {}, [], False, error=("bad_metadata", str(err)))
    if ds.hub:
        listing.link_root = root.parent.parent  # <cache>/datasets--org--name/snapshots/<commit>
    for role, folder in folders.items():
        if os.path.isdir(folder):
            listing.aux_roots[role] = folder
            listing.aux[role] = _aux_files(folder, vcfg.image_exts, with_stats, listing, exclude)
    return listing


def dataset_root(ds: DatasetConfig) -> tuple[Path, tuple[str, str] | None]:
    """The folder a dataset is read from (``path``, or the hub snapshot of ``hub``), and why not when
    it cannot be had (never raises: Snakemake calls this while building its DAG)."""
    if ds.hub is None:
        return Path(ds.path or ".").absolute(), None
    try:
        return hub.resolve(ds.hub, ds.revision), None
    except hub.HubError as err:
        return hub.cache_folder(), ("missing_dataset", f"datasets[{ds.name}].hub: {err}")


def _table_listing(root: Path, table: Tables, with_stats: bool) -> Listing:
    """A table dataset's listing: no media files; its table files (with stats) describe it."""
    listing = Listing(root, {}, [], True, table=table)
    if with_stats:
        for path in (*table.files, *table.extra):
            try:
                st = os.stat(path)
            except OSError:
                continue
            listing.stats[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns)
    return listing


def dataset_files(ds: DatasetConfig, vcfg: ValidationConfig, exclude: tuple[str, ...] = ()) -> list[Path]:
    """Every media, caption and metadata file of a dataset (absolute, sorted).

    Broken links, loops, badly named and unreadable files are left out
    (Snakemake would fail on them); validation reports them.
    """
    listing = list_dataset(ds, vcfg, exclude=exclude)
    root = str(listing.root)
    paths = [os.path.join(root, rel) for rel in (*listing.media, *listing.captions, *listing.metadata)]
    paths += [p for files in listing.aux.values() for p in files.values()]
    if listing.table:
        paths += [*listing.table.files, *listing.table.extra]
    return sorted(Path(p) for p in paths if os.access(p, os.R_OK))


# -- validation shards (diffpipe.data.dataset.vshards) -----------------------------
def vshard_name(index: int) -> str:
    """Name of validation shard ``index`` (``v0003``): kept apart from cache shards (``s0003``)."""
    return f"v{index:04d}"


def vshard_names(shards: int) -> list[str]:
    """Every validation shard's name; none when validation runs as one job (``shards == 1``)."""
    return [vshard_name(i) for i in range(shards)] if shards > 1 else []


def vshard_of(dataset: str, relpath: str, shards: int) -> int:
    """The validation shard of a media file: its item id (a digest of the dataset name and relative
    path, :func:`diffpipe.data.dataset.validate.item_id`) modulo ``shards``; stable while files come and go."""
    return int(digest([dataset, relpath])[:16], 16) % shards
