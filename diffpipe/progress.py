"""Live progress of a run's jobs: each job writes a small status file that ``diffpipe run`` and
``diffpipe status`` read.

A job (training, a cache shard) makes one :class:`Progress` and calls :meth:`Progress.update` as its
work gets done. The status goes to ``<output_dir>/progress/<job>.json``, written atomically (a
temporary file, then ``os.replace``) at most every :data:`MIN_INTERVAL_S` seconds, so a reader never
sees half a file. The job also shows it: a rich progress line on a terminal, otherwise a plain log
line every ``DIFFPIPE_PROGRESS_SECONDS`` seconds (default 30), which is what a Snakemake job log or a
SLURM log holds. ``DIFFPIPE_QUIET=1`` (``diffpipe --quiet``) hides both; the file is still written.

The files are run state, like ``logs/``: no rule reads or writes them, no digest covers them, and a
rerun overwrites them. Only rank 0 of a multi-process training writes one.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, TextColumn
from rich.progress import Progress as RichProgress

from diffpipe.paths import PROGRESS_DIR
from diffpipe.utils import write_text_atomic

SECONDS_ENV = "DIFFPIPE_PROGRESS_SECONDS"
DEFAULT_SECONDS = 30.0  # between plain log lines
MIN_INTERVAL_S = 0.5  # between writes of the status file
STALE_AFTER_S = 900.0  # a running job whose process cannot be checked (another host) and whose file is this old
_WINDOW = 32  # updates the rate is measured over: recent speed, not the average since the start
_LOSS_BETA = 0.9  # the loss shown is this exponential moving average (bias-corrected)


@dataclass
class JobState:
    """What a job's status file holds."""

    job: str  # file name: "train", "cache_latents-s0000"
    stage: str  # "train", "cache latents", ...
    done: int
    total: int
    started: float  # Unix time
    updated: float
    unit: str = "step"
    shard: str | None = None
    state: str = "running"  # running, finished or failed (as the job last wrote it)
    rate: float | None = None  # units per second, over the last updates
    samples_rate: float | None = None
    eta: float | None = None  # seconds left at ``rate``
    loss_ema: float | None = None
    last_eval: float | None = None
    gpu_mem_mb: float | None = None
    pid: int = 0
    host: str = ""

    @classmethod
    def read(cls, path: Path) -> JobState | None:
        """The state in ``path``; None when it is not one (a file of another version, or damaged)."""
        try:
            data = json.loads(path.read_text())
            known = {f.name for f in fields(cls)}
            return cls(**{k: v for k, v in data.items() if k in known})
        except (OSError, ValueError, TypeError):
            return None

    def condition(self, now: float, host: str | None = None) -> str:
        """``running``, ``finished``, ``failed``, or ``stale``: it says running but its process is gone (this
        host) or its file has not changed for :data:`STALE_AFTER_S` seconds (another host: no pid to check)."""
        if self.state != "running":
            return self.state
        if self.host == (host or socket.gethostname()):
            return "running" if _alive(self.pid) else "stale"
        return "stale" if now - self.updated > STALE_AFTER_S else "running"

    def label(self) -> str:
        return f"{self.stage} {self.shard}" if self.shard else self.stage

    def describe(self) -> str:
        """``step 40/80 (50%), loss 0.5123, 3.10 it/s, 12.4 samples/s, ETA 0:00:13, eval 0.6100, GPU 1.2 GiB``."""
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        count = f"step {self.done}/{self.total}" if self.unit == "step" else f"{self.done}/{self.total} {self.unit}s"
        parts = [count + pct]
        if self.loss_ema is not None:
            parts.append(f"loss {self.loss_ema:.4f}")
        if self.rate:
            parts.append(rate_text(self.rate, self.unit))
        if self.samples_rate:
            parts.append(f"{self.samples_rate:.1f} samples/s")
        if self.eta is not None and self.done < self.total:
            parts.append(f"ETA {duration(self.eta)}")
        if self.last_eval is not None:
            parts.append(f"eval {self.last_eval:.4f}")
        if self.gpu_mem_mb is not None:
            parts.append(f"GPU {self.gpu_mem_mb / 1024:.1f} GiB")
        return ", ".join(parts)


class Progress:
    """A job's progress: its status file and what it shows (see the module docstring).

    ``root``: the run's output_dir (None: show only, no file). ``start``: units already done (a resumed
    run). ``samples_per_unit``: for samples/s. ``display``: ``auto`` (rich on a terminal, else plain
    lines), ``rich``, ``plain`` or ``none``. ``every_s``: seconds between plain lines (default
    ``DIFFPIPE_PROGRESS_SECONDS``). Use as a context manager: leaving by an exception records ``failed``.
    """

    def __init__(self, root: str | os.PathLike | None, job: str, *, stage: str, total: int, unit: str = "step",
                 shard: str | None = None, start: int = 0, samples_per_unit: int | None = None,
                 log: Callable[[str], None] | None = None, display: str = "auto", every_s: float | None = None,
                 clock: Callable[[], float] = time.time):
        self.path = Path(root) / PROGRESS_DIR / f"{job}.json" if root is not None else None
        self.log, self.clock, self.samples_per_unit = log or _stderr_line, clock, samples_per_unit
        now = clock()
        self.state = JobState(job, stage, start, total, now, now, unit=unit, shard=shard, pid=os.getpid(),
                              host=socket.gethostname())
        self.every_s = every_s if every_s is not None else _env_seconds()
        self.window: deque[tuple[float, int]] = deque([(now, start)], maxlen=_WINDOW)
        self.loss_n, self._ema = 0, 0.0
        self.written = self.logged = -math.inf
        self.display = _display(display)
        self.bar = _RichBar(self.state.label(), total, start) if self.display == "rich" else None
        self._write(now)

    def update(self, done: int, *, loss: float | None = None, last_eval: float | None = None,
               gpu_mem_mb: float | None = None) -> None:
        """``done`` units of ``total`` are done; the step's ``loss``, the latest eval loss, GPU memory in MiB."""
        now, s = self.clock(), self.state
        s.done, s.updated = done, now
        self.window.append((now, done))
        if loss is not None and math.isfinite(loss):  # a skipped (non-finite) step does not poison the average
            self.loss_n += 1
            self._ema = _LOSS_BETA * self._ema + (1 - _LOSS_BETA) * loss
            s.loss_ema = self._ema / (1 - _LOSS_BETA**self.loss_n)
        if last_eval is not None:
            s.last_eval = last_eval
        if gpu_mem_mb is not None:
            s.gpu_mem_mb = gpu_mem_mb
        s.rate = window_rate(self.window)
        s.samples_rate = s.rate * self.samples_per_unit if s.rate and self.samples_per_unit else None
        s.eta = eta_seconds(done, s.total, s.rate)
        last = done >= s.total
        if last or now - self.written >= MIN_INTERVAL_S:
            self._write(now)
        if self.bar is not None:
            self.bar.update(done, s.describe())
        elif self.display == "plain" and (last or now - self.logged >= self.every_s):
            self.logged = now
            self.log(f"{s.label()}: {s.describe()}")

    def close(self, state: str = "finished") -> None:
        """Record the job's end (``finished`` or ``failed``) and stop the rich line."""
        self.state.state = state
        self._write(self.clock())
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close("failed" if exc_type is not None else "finished")

    def _write(self, now: float) -> None:
        self.written = now
        if self.path is None:
            return
        try:  # run state, not an output: not synced to disk, and a full disk must not stop the job
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.path, json.dumps(asdict(self.state)), durable=False)
        except OSError:
            pass


def window_rate(window: deque[tuple[float, int]] | list[tuple[float, int]]) -> float | None:
    """Units per second between the first and the last (time, done) of ``window``; None before any time passed."""
    (t0, d0), (t1, d1) = window[0], window[-1]
    return (d1 - d0) / (t1 - t0) if t1 > t0 and d1 > d0 else None


def eta_seconds(done: int, total: int, rate: float | None) -> float | None:
    """Seconds until ``total`` at ``rate`` units per second (0 when done; None without a rate)."""
    if done >= total:
        return 0.0
    return (total - done) / rate if rate else None


def rate_text(rate: float, unit: str) -> str:
    """``3.10 it/s`` for steps (``4.2 s/it`` below one a second); ``25.0 items/s`` for others."""
    if unit != "step":
        return f"{rate:.1f} {unit}s/s"
    return f"{rate:.2f} it/s" if rate >= 1 else f"{1 / rate:.1f} s/it"


def duration(seconds: float) -> str:
    """``0:00:13``, ``1:02:03``; days as hours."""
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


# -- jobs that do not know their run folder: the CLI names it around the library call ------------------
_job: dict[str, Any] | None = None


@contextmanager
def job(root: str | os.PathLike, name: str, *, stage: str, shard: str | None = None) -> Iterator[None]:
    """Within this block, :func:`start` writes ``<root>/progress/<name>.json`` (``diffpipe cache`` sets it)."""
    global _job
    before, _job = _job, {"root": root, "job": name, "stage": stage, "shard": shard}
    try:
        yield
    finally:
        _job = before


def start(total: int, *, unit: str, stage: str, shard: str | None = None, log: Callable[[str], None] | None = None
          ) -> Progress:
    """A :class:`Progress` for the job :func:`job` named (none named: show only, no file)."""
    where = _job or {"root": None, "job": stage, "stage": stage, "shard": shard}
    return Progress(where["root"], where["job"], stage=where["stage"], shard=where["shard"], total=total,
                    unit=unit, log=log)


# -- reading ------------------------------------------------------------------------------------------
def read_jobs(root: str | os.PathLike) -> list[JobState]:
    """Every job state under ``<root>/progress`` (sorted by start time); unreadable files are left out."""
    folder = Path(root) / PROGRESS_DIR
    found = [JobState.read(p) for p in sorted(folder.glob("*.json"))] if folder.is_dir() else []
    return sorted((s for s in found if s is not None), key=lambda s: (s.started, s.job))


def status_lines(root: str | os.PathLike, now: float | None = None) -> list[str]:
    """One line per job of the run at ``root``: its condition, what it did, and when it last wrote."""
    now = time.time() if now is None else now
    jobs = read_jobs(root)
    if not jobs:
        return [f"status: no job has reported progress in {Path(root) / PROGRESS_DIR} yet"]
    width = max(len(s.label()) for s in jobs)
    host = socket.gethostname()
    lines = []
    for s in jobs:
        where = f" on {s.host}" if s.host != host else ""
        lines.append(f"{s.label():<{width}}  {s.condition(now, host):<8}  {s.describe()}  "
                     f"(updated {duration(max(0.0, now - s.updated))} ago{where}, pid {s.pid})")
    return lines


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process holds the pid: alive
        return True
    return True


def _stderr_line(text: str) -> None:
    # Flushed: a job's log is a file, where output is block-buffered and would show up only at the end.
    print(text, file=sys.stderr, flush=True)


def _env_seconds() -> float:
    try:
        return max(0.0, float(os.environ.get(SECONDS_ENV, DEFAULT_SECONDS)))
    except ValueError:
        return DEFAULT_SECONDS


def _display(display: str) -> str:
    if os.environ.get("DIFFPIPE_QUIET") == "1":
        return "none"
    if display == "auto":
        return "rich" if sys.stderr.isatty() else "plain"
    return display


class _RichBar:
    """The progress line on a terminal (stderr): label, bar, and the state's description."""

    def __init__(self, label: str, total: int, done: int):
        self.progress = RichProgress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                                     console=Console(stderr=True))
        self.task = self.progress.add_task(label, total=total, completed=done, info="")
        self.progress.start()

    def update(self, done: int, info: str) -> None:
        self.progress.update(self.task, completed=done, info=info)

    def stop(self) -> None:
        self.progress.stop()
