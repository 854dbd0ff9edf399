"""One writer per run folder: an exclusive ``flock`` on a lock file inside ``output_dir``.

Snakemake locks its working directory (``.snakemake/locks``), not the run
folder: two ``diffpipe run`` started from different folders on one
``output_dir`` both went ahead and trained into the same ``train/``. The lock
file lives in the run folder itself, so every process that writes there sees it,
whatever its working directory.

Two locks, two files: ``diffpipe run`` holds :data:`RUN_LOCK` while Snakemake
runs; ``diffpipe train`` holds :data:`TRAIN_LOCK` while it trains. The train job
that a locked run starts takes only the train lock, so the run's own jobs are
never blocked by their parent, while a second ``diffpipe run`` (run lock) or a
second ``diffpipe train`` (train lock) on the same folder is refused.

``flock`` is released by the kernel when the holder exits, even killed by
SIGKILL: no stale lock to clean up, and the file is never deleted (deleting a
lock file lets a third process lock a new file while the second holds the old).
On file systems without ``flock`` support the run goes on with a warning.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

RUN_LOCK = ".diffpipe-run.lock"
TRAIN_LOCK = ".diffpipe-train.lock"

# Set by the process holding a lock for the processes it launches itself (the ranks of
# `diffpipe train --processes N`): they run under their parent's lock.
HELD_ENV = "DIFFPIPE_LOCK_HELD"

_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class FolderLocked(RuntimeError):
    """Another process holds the run folder's lock; the message names the folder and the holder."""


def _holder(fd: int) -> str:
    text = os.pread(fd, 200, 0).decode(errors="replace").split()
    if len(text) >= 3:
        pid, host, since = text[:3]
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(since)))
        return f"pid {pid} on {host}, since {when}"
    return "pid unknown (it is just starting)"


@contextmanager
def hold(folder: str | Path, name: str, what: str, *, warn: Callable[[str], None] | None = None) -> Iterator[Path]:
    """Hold an exclusive lock on ``folder/name`` (created, with ``folder``, if missing) until exit.

    Raises :class:`FolderLocked` at once (never waits) when another process holds it;
    ``what`` names the command in that message, e.g. ``"diffpipe run"``.
    """
    folder = Path(folder)
    path = folder / name
    if os.environ.get(HELD_ENV) == str(path.resolve()):
        yield path  # our launcher holds it for us
        return
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FolderLocked(
                f"{folder} is in use by another {what} ({_holder(fd)}; lock file {path}). "
                f"Wait for it to finish or stop it; two {what} writing one run folder would "
                "overwrite each other's outputs."
            ) from None
        except OSError as err:
            if err.errno not in _UNSUPPORTED:
                raise
            if warn:
                warn(f"warning: cannot lock {path} ({err.strerror}): this file system has no flock; "
                     f"make sure no other {what} uses {folder}")
        else:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {socket.gethostname()} {time.time():.0f}\n".encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the lock

