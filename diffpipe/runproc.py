"""A run's processes as one unit: Snakemake and its jobs start, stop and end together.

``diffpipe run`` starts Snakemake in a session of its own, holding the run lock
(:mod:`diffpipe.runlock`) through the descriptor it inherits, and forwards
SIGINT and SIGTERM (SIGHUP as SIGTERM) to that session's process group, which
holds every job. It returns only when no process of the group is left: a second signal, or
:data:`GRACE_S` seconds after the first, kills what remains. ``diffpipe run``
also makes itself the "subreaper" of the jobs Snakemake leaves behind, so their
exits are collected even where process 1 of a container never collects them.

:func:`run_lock` holds the run folder for the run and, once the locks proved that
no process of an earlier run is alive, removes the lock files an interrupted
Snakemake left for this run folder (:func:`clear_stale_snakemake_lock`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from diffpipe import runlock

GRACE_S = 30.0  # after the first forwarded signal: time for jobs to stop before they are killed
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_CHILD_SUBREAPER = 36


@dataclass
class Finished:
    returncode: int
    signal: int | None  # the signal that interrupted the run, if one did


def run_group(cmd: list[str], *, env: dict[str, str], cwd: Path, pass_fds: tuple[int, ...] = (),
              say: Callable[[str], None] = print, output: Callable[[str], None] | None = None) -> Finished:
    """Run ``cmd`` in a new session; forward signals to it; return once its whole process group ended.

    ``output``: given each line ``cmd`` writes to stderr (where Snakemake logs), instead of the terminal
    getting it (``diffpipe run``'s live display prints them above itself); stdout stays as it is.
    """
    _become_subreaper()
    group = _Group(say)
    with group.forwarding():
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, start_new_session=True, pass_fds=pass_fds,
                                stderr=subprocess.PIPE if output is not None else None)
        group.pgid = proc.pid
        reader = _pump(proc.stderr, output) if output is not None else None
        if group.signum is not None:  # a signal that came while it started
            group.send(_forwarded(group.signum))
        rc = group.wait(proc)
        group.drain()
    if reader is not None:
        # The group is gone, so the pipe is closed, unless a process that left the group still holds it.
        reader.join(timeout=5)
    return Finished(rc, group.signum)


def _pump(stream, output: Callable[[str], None]) -> threading.Thread:
    def copy() -> None:
        for raw in iter(stream.readline, b""):
            try:
                output(raw.decode(errors="replace").rstrip("\r\n"))
            except OSError:  # the terminal is gone: keep reading, or Snakemake would block on a full pipe
                pass
        stream.close()

    thread = threading.Thread(target=copy, name="diffpipe-run-output", daemon=True)
    thread.start()
    return thread


class _Group:
    def __init__(self, say: Callable[[str], None]):
        self.say, self.pgid, self.signum, self.deadline, self.killed = say, None, None, None, False

    @contextmanager
    def forwarding(self) -> Iterator[None]:
        # A signal ignored here stays ignored (nohup's SIGHUP, SIGINT in a shell's background job); Snakemake
        # inherits that too.
        old = {s: signal.signal(s, self._on_signal) for s in _FORWARDED if signal.getsignal(s) != signal.SIG_IGN}
        try:
            yield
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)

    def _on_signal(self, signum: int, _frame) -> None:
        if self.signum is None:
            self.signum, self.deadline = signum, time.monotonic() + GRACE_S
            self.send(_forwarded(signum))
            self._tell(f"diffpipe run: {signal.Signals(signum).name}: stopping Snakemake and its jobs (again to "
                       f"kill them now; killed anyway after {GRACE_S:.0f} s)")
        else:
            self.kill()

    def _tell(self, text: str) -> None:
        try:
            self.say(text)
        except OSError:  # the terminal is gone (SIGHUP): stopping the run matters, not the message
            pass

    def send(self, signum: int) -> None:
        if self.pgid is not None:
            try:
                os.killpg(self.pgid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        if not self.killed:
            self.killed = True
            self._tell("diffpipe run: killing the run's remaining processes")
            self.send(signal.SIGKILL)

    def _overdue(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.kill()

    def wait(self, proc: subprocess.Popen) -> int:
        while True:
            try:
                return proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                self._overdue()

    def drain(self) -> None:
        """Wait until no process of the group is left (Snakemake gone, a job may not be)."""
        if self._alive() and self.deadline is None:
            # Snakemake ended and left processes behind (it was killed, or a job left a child): stop them.
            self.deadline = time.monotonic() + GRACE_S
            self._tell("diffpipe run: Snakemake ended before all its jobs did: stopping them")
            self.send(signal.SIGTERM)
        while self._alive():
            self._overdue()
            time.sleep(0.2)

    def _alive(self) -> bool:
        _reap(self.pgid)
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _forwarded(signum: int) -> int:
    # Snakemake stops its jobs and removes its lock on SIGINT and SIGTERM; SIGHUP would kill it outright.
    return signal.SIGTERM if signum == signal.SIGHUP else signum


def _reap(pgid: int) -> None:
    """Collect the exit of the group's orphans handed to this process (the subreaper); Snakemake's already is.

    Only children of that group: another child of this process keeps its status for its own ``wait``.
    """
    while True:
        try:
            pid, _ = os.waitpid(-pgid, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _become_subreaper() -> None:
    try:  # Linux only; elsewhere orphans go to process 1, which collects them
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


# -- the run lock and Snakemake's own lock ---------------------------------------------------
@contextmanager
def run_lock(root: Path, workdir: Path, env: dict[str, str], *, say: Callable[[str], None],
             dry_run: bool = False) -> Iterator[tuple[int, ...]]:
    """Hold the run folder ``root`` for a run; yields the descriptors Snakemake must inherit.

    Snakemake's own lock is per working directory: a second run on this output_dir
    from another folder would pass it. A dry run writes nothing and is not locked.
    Sets :data:`runlock.HELD_ENV` in ``env``: the jobs run under this lock.
    """
    if dry_run:
        yield ()
        return
    with runlock.hold(root, runlock.RUN_LOCK, "diffpipe run", warn=say) as held:
        runlock.check_no_jobs(root)  # an earlier run's Snakemake may be gone, a job not
        runlock.check_free(root, runlock.TRAIN_LOCK, "diffpipe train")
        env[runlock.HELD_ENV] = runlock.held_env(held)
        if stale := clear_stale_snakemake_lock(workdir, root):
            say(f"diffpipe run: removed Snakemake's lock left by an interrupted run on this output_dir "
                f"({', '.join(f.name for f in stale)} in {stale[0].parent}); no process of that run is alive")
        # Snakemake holds the lock too: a kill -9 of diffpipe alone leaves the run locked.
        fd = runlock.held_fd(held)
        yield () if fd is None else (fd,)


def clear_stale_snakemake_lock(workdir: Path, output_dir: Path) -> list[Path]:
    """Remove the lock files Snakemake left in ``workdir`` for a run on ``output_dir``; returns them.

    Call only while holding the run lock with no job of an earlier run alive
    (:func:`diffpipe.runlock.check_no_jobs`): then every Snakemake that wrote a
    lock naming files in ``output_dir`` is dead. Locks naming only other files
    (a run on another output_dir from the same folder) are left alone.
    """
    locks = workdir / ".snakemake" / "locks"
    if not locks.is_dir():
        return []
    pairs: dict[str, list[Path]] = {}
    for f in locks.iterdir():
        number, _, kind = f.name.partition(".")
        if number.isdigit() and kind in ("input.lock", "output.lock") and f.is_file():
            pairs.setdefault(number, []).append(f)
    removed = []
    for files in pairs.values():
        if any(_names_inside(f, workdir, output_dir) for f in files):
            for f in files:
                f.unlink(missing_ok=True)
                removed.append(f)
    return sorted(removed)


def _names_inside(lock: Path, workdir: Path, output_dir: Path) -> bool:
    """Whether a lock file lists a path in ``output_dir``: one path a line, relative to ``workdir`` or absolute.

    Matched on the raw text (a name may hold a newline, which splits it over two lines).
    """
    try:
        text = "\n" + lock.read_text(errors="replace")
    except OSError:
        return False
    output_dir = output_dir.resolve()
    prefixes = {f"\n{output_dir}{os.sep}"}
    if output_dir.is_relative_to(workdir.resolve()):
        prefixes.add(f"\n{output_dir.relative_to(workdir.resolve())}{os.sep}")
    return any(p in text for p in prefixes)
