"""Is ``output_dir`` diffpipe's run folder? Checked by ``diffpipe run`` before Snakemake starts.

Snakemake deletes a job's old outputs before it runs the job (a ``directory()``
output with everything in it), and the Snakefile writes into ``output_dir`` as
it loads: a user's ``plan/`` or ``samples/`` there would be gone before any of
diffpipe's own checks ran. So a run goes only into a new or empty folder, which
it claims with a record in its :data:`~diffpipe.utils.OUTPUT_MARKER`, or into a
folder holding that record made for this very folder: the record names the
folder's inode, which a copy of the record (or of the whole folder) does not
have. Inside a folder of ours, each existing ``directory()`` output must hold
only what diffpipe wrote there (:func:`~diffpipe.utils.foreign_entries`).

Not the folder's device number nor its path: both differ between the machines of
a cluster that mount one network file system (and the device number between two
mounts of it), while the inode stays; a folder moved on its disk stays ours.
"""

from __future__ import annotations

import os
from pathlib import Path

from diffpipe import runlock
from diffpipe.paths import DIRECTORY_OUTPUTS
from diffpipe.utils import NotOurFolderError, foreign_entries, read_marker, write_marker

#: The marker field that makes a folder a run folder: {"path": ..., "inode": ...} of the folder it was made for.
RUN_RECORD = "run_folder"
_SHOWN = 5


def check_run_folder(root: str | os.PathLike) -> None:
    """Refuse ``root`` (a run's ``output_dir``) unless running there loses nothing of the user's.

    A missing or empty folder is created and claimed; a folder this check claimed
    before passes when every ``directory()`` output in it holds only diffpipe's
    files. Anything else raises :class:`~diffpipe.utils.NotOurFolderError`
    naming the folder and the files, before anything is written.
    """
    root = Path(root)
    if (root.exists() or root.is_symlink()) and not root.is_dir():  # a file, or a link to none
        raise NotOurFolderError(f"output_dir {root} is not a folder (a file or a broken link); diffpipe writes "
                                "a folder there and never replaces a file with one. Choose another output_dir.")
    if not root.exists():
        root.mkdir(parents=True)
    marker = read_marker(root)
    if not _made_for(root, marker):
        if any(root.iterdir()):
            raise _not_ours(root, marker)
        record = {"path": str(root.resolve()), "inode": root.stat().st_ino}
        write_marker(root, {}, {RUN_RECORD: record})
    if not _busy(root):  # a run or train writing there now: its lock refuses this run, not a half-written plan/
        _check_directory_outputs(root)


def _busy(root: Path) -> bool:
    try:
        for name in (runlock.RUN_LOCK, runlock.TRAIN_LOCK):
            runlock.check_free(root, name, "diffpipe")
    except runlock.FolderLocked:
        return True
    return False


def _made_for(root: Path, marker: dict | None) -> bool:
    record = (marker or {}).get(RUN_RECORD)
    return isinstance(record, dict) and record.get("inode") == root.stat().st_ino


def _not_ours(root: Path, marker: dict | None) -> NotOurFolderError:
    record = (marker or {}).get(RUN_RECORD)
    if isinstance(record, dict):
        return NotOurFolderError(
            f"output_dir {root} holds a diffpipe run record made for another folder ({record.get('path')}): it "
            "was copied from that run folder (or moved to another disk), and diffpipe cannot tell its own outputs "
            "in it from files of yours. Choose a new output_dir (with cache.dir set, runs share their caches).")
    doomed = _existing_directory_outputs(root)
    deletes = f" ({', '.join(str(p.relative_to(root)) for p in doomed)} with all they hold)" if doomed else ""
    return NotOurFolderError(
        f"output_dir {root} already exists and holds files diffpipe did not write there ({_files_in(root)}). "
        f"Snakemake deletes a job's old outputs before it runs the job{deletes}, so diffpipe runs only into a "
        "new or empty folder, or one a diffpipe run made. Choose another output_dir, or move those files away. "
        "(A run folder of an earlier diffpipe, from before diffpipe recorded its run folders, has no record: "
        "move it away to run again; set cache.dir to its cache/store to reuse the entries it encoded.)")


def _files_in(root: Path) -> str:
    """A few files under ``root`` (top-down, sorted), without walking all of a big folder."""
    found: list[str] = []
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        found += [(Path(folder, f).relative_to(root)).as_posix() for f in sorted(files)]
        if len(found) > _SHOWN:
            return ", ".join(found[:_SHOWN]) + " and more"
    return ", ".join(found) or ", ".join(sorted(os.listdir(root)))


def _existing_directory_outputs(root: Path) -> list[Path]:
    """The directory() outputs present under ``root`` (every shard's), whatever they are."""
    found = []
    for template in DIRECTORY_OUTPUTS:
        pattern = template.format(shard="*")  # the shard wildcard; the other outputs have none
        found += [p for p in sorted(root.glob(pattern)) if p.exists() or p.is_symlink()]
    return found


def _check_directory_outputs(root: Path) -> None:
    problems = []
    for path in _existing_directory_outputs(root):
        if path.is_symlink() or not path.is_dir():
            problems.append(f"{path} (a {'link' if path.is_symlink() else 'file'}, not a folder of diffpipe's)")
        elif foreign := foreign_entries(path):
            shown = ", ".join(foreign[:_SHOWN]) + (f" and {len(foreign) - _SHOWN} more" if len(foreign) > _SHOWN else "")
            problems.append(f"{path} ({shown})")
    if problems:
        raise NotOurFolderError(
            f"output_dir {root}: Snakemake deletes these folders, with all they hold, before the jobs that write "
            f"them, and they hold files diffpipe did not write (or that changed since): {'; '.join(problems)}. "
            "Move those files away, then run again.")
