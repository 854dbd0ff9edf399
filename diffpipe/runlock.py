"""One writer per run folder: an exclusive ``flock`` on a lock file inside ``output_dir``.

Snakemake locks its working directory (``.snakemake/locks``), not the run
folder: two ``diffpipe run`` started from different folders on one
``output_dir`` both went ahead and trained into the same ``train/``. The lock
files live in the run folder itself, so every process that writes there sees
them, whatever its working directory.

Two locks, two files: ``diffpipe run`` holds :data:`RUN_LOCK` while Snakemake
runs, ``diffpipe train`` holds :data:`TRAIN_LOCK` while it trains, and each
first takes its own lock and then checks that the other one is free. The
processes a lock holder starts itself (the run's Snakemake jobs, the ranks of
``diffpipe train --processes N``) find the lock named in :data:`HELD_ENV` and
run under it: the run's own train job is never blocked by its parent, while a
second run, or a direct ``diffpipe train`` beside a run, is refused.

``flock`` is released by the kernel when the holder exits, even killed by
SIGKILL: no stale lock to clean up, and the file is never deleted (deleting a
lock file lets a third process lock a new file while the second holds the old).
On file systems without ``flock`` support the run goes on with a warning.

A run lives as long as any of its processes: ``diffpipe run`` hands its locked
file description to Snakemake (:func:`held_fd`), so the lock outlives a
``kill -9`` of ``diffpipe run`` alone; and each job of a run (every ``diffpipe``
command started under :data:`RUN_LOCK`) holds a shared lock on :data:`JOBS_LOCK`
(:func:`join_run`) until it exits, because Snakemake closes every inherited file
descriptor before it starts a job. A new run, or a direct ``diffpipe train``,
is refused while either is held.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

RUN_LOCK = ".diffpipe-run.lock"
TRAIN_LOCK = ".diffpipe-train.lock"
JOBS_LOCK = ".diffpipe-jobs.lock"  # shared by the live jobs of a run

# The lock files (JSON list of resolved paths) held by an ancestor of this process, for it.
HELD_ENV = "DIFFPIPE_LOCK_HELD"

_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}

_FDS: dict[Path, int] = {}  # lock file -> the descriptor holding it, while held by this process
_JOINED: list[int] = []  # this job's shared locks on its runs' JOBS_LOCK: held until it exits


class FolderLocked(RuntimeError):
    """Another process holds the run folder's lock; the message names the folder and the holder."""


def _held() -> list[str]:
    try:
        held = json.loads(os.environ.get(HELD_ENV) or "[]")
    except ValueError:
        return []
    return [str(p) for p in held] if isinstance(held, list) else []


def held_env(path: Path) -> str:
    """:data:`HELD_ENV`'s value for the processes this one starts under its lock ``path``."""
    return json.dumps([*_held(), str(Path(path).resolve())])


def _holder(fd: int) -> str:
    text = os.pread(fd, 200, 0).decode(errors="replace").split()
    if len(text) >= 3:
        pid, host, since = text[:3]
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(since)))
        return f"pid {pid} on {host}, since {when}"
    return "pid unknown (it is just starting)"


def _locked(folder: Path, path: Path, what: str, fd: int) -> FolderLocked:
    return FolderLocked(
        f"{folder} is in use by a {what} ({_holder(fd)}; lock file {path}). Wait for it to finish "
        "or stop it: two processes writing one run folder would overwrite each other's outputs."
    )


@contextmanager
def hold(folder: str | Path, name: str, what: str, *, warn: Callable[[str], None] | None = None) -> Iterator[Path]:
    """Hold an exclusive lock on ``folder/name`` (created, with ``folder``, if missing) until exit.

    Raises :class:`FolderLocked` at once (never waits) when another process holds it;
    ``what`` names the command holding it in that message, e.g. ``"diffpipe run"``.
    """
    folder = Path(folder)
    path = folder / name
    if str(path.resolve()) in _held():
        yield path  # the process that started this one holds it for us
        return
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _locked(folder, path, what, fd) from None
        except OSError as err:
            if err.errno not in _UNSUPPORTED:
                raise
            if warn:
                warn(f"warning: cannot lock {path} ({err.strerror}): this file system has no flock; "
                     f"make sure nothing else writes {folder}")
        else:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {socket.gethostname()} {time.time():.0f}\n".encode(), 0)
            _FDS[path] = fd
        yield path
    finally:
        _FDS.pop(path, None)
        os.close(fd)  # releases the lock (unless a child process still holds the same description)


def held_fd(path: Path) -> int | None:
    """The descriptor holding lock ``path`` in this process (to hand to a child: ``pass_fds``), if any."""
    return _FDS.get(Path(path))


def check_free(folder: str | Path, name: str, what: str) -> None:
    """Raise :class:`FolderLocked` if another process holds ``folder/name`` (held for this one: fine).

    For :data:`RUN_LOCK`, a job of a run that still runs counts as holding it.
    """
    path = Path(folder) / name
    if str(path.resolve()) in _held():
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _locked(Path(folder), path, what, fd) from None
    except OSError as err:
        if err.errno not in _UNSUPPORTED:
            raise
    finally:
        os.close(fd)
    if name == RUN_LOCK:
        check_no_jobs(folder)  # a run whose Snakemake is gone may still have a job writing here


def check_no_jobs(folder: str | Path) -> None:
    """Raise :class:`FolderLocked` while a job of a run on ``folder`` still runs (its Snakemake may be gone)."""
    path = Path(folder) / JOBS_LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)  # NFS emulates flock with fcntl: LOCK_EX needs write access
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the close below: only a test
    except BlockingIOError:
        raise FolderLocked(
            f"{folder} is in use: a job of an earlier diffpipe run on it is still running (lock file {path}), "
            "though that run's diffpipe and Snakemake are gone. Wait for it to end or stop it (e.g. "
            f"`fuser -v {shlex.quote(str(path))}` lists it)."
        ) from None
    except OSError as err:
        if err.errno not in _UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def join_run(wait_s: float = 10.0) -> None:
    """In a job of a run (:data:`HELD_ENV` names a :data:`RUN_LOCK`): hold a shared lock on its JOBS_LOCK.

    Held until this process exits, so a later run knows the job is alive even if
    the run's Snakemake was killed. :func:`check_no_jobs` takes the lock for an
    instant to test it: retry for ``wait_s``.
    """
    for held in map(Path, _held()):
        if held.name != RUN_LOCK or not held.parent.is_dir():
            continue
        fd = os.open(held.parent / JOBS_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        end = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() < end:
                    time.sleep(0.05)
                    continue
            except OSError as err:
                if err.errno not in _UNSUPPORTED:
                    raise
            break
        _JOINED.append(fd)
