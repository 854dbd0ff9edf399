"""An interrupted `diffpipe run` recovers by itself (#38): real runs, real Snakemake, real signals.

One tiny run (8 images, 32 px, 8 training steps, a checkpoint every 2) in folders
with hostile names, driven to the train job only. ``DIFFPIPE_FAULT=after-step:N:hang``
parks the train job after step N, so each signal lands while a job runs. The tests
share the run folder, in file order: kill -9 of diffpipe alone, then of its Snakemake
too, then SIGINT (Ctrl-C) and SIGTERM each after a resume, then a plain run finishing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from diffpipe.data.dataset.demo import write_demo_dataset
from diffpipe.paths import RunPaths

pytestmark = pytest.mark.slow

NAME = "'sq' \"dq\" [/x] $(touch PWNED); nl"
STEP = "train: resumed from step {}"


class Run:
    """`diffpipe run` in its own process group, as a shell starts a foreground command.

    Its output goes to a file: a pipe would stay open as long as any job that inherited it.
    """

    def __init__(self, case, *, hang: int | None):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("DIFFPIPE_FAULT", None)
        if hang is not None:
            env["DIFFPIPE_FAULT"] = f"after-step:{hang}:hang"
        case["runs"] += 1
        self.out = case["root"] / f"run-{case['runs']}.txt"
        args = ["run", "-c", str(case["config"]), "--cores", "2", "--target", "train"]
        with open(self.out, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "diffpipe", *args], cwd=case["work"], env=env,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_terminal_signals)
        self.pid = self.proc.pid

    def finish(self, timeout: float) -> tuple[int, str]:
        rc = self.proc.wait(timeout=timeout)
        return rc, self.out.read_text(errors="replace")


def _terminal_signals() -> None:
    """Start the run with SIGINT and SIGTERM at their defaults, as a terminal's shell does: an ignored signal is
    inherited across exec, and a test run earlier in this pytest process may have left SIGINT ignored (then
    Snakemake and the train job never see the Ctrl-C this file sends)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def _alive(root: Path) -> list[int]:
    """Live processes working in the test's folder: the run's diffpipe, its Snakemake and their jobs."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
            live = (entry / "cmdline").read_bytes() != b""  # a zombie has none
        except OSError:
            continue
        if live and (cwd == str(root) or cwd.startswith(f"{root}{os.sep}")):
            found.append(int(entry.name))
    return found


def _wait_for(check, what: str, timeout: float = 600) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.2)


def _parked(case, step: int, run: Run) -> None:
    """Wait until the train job wrote checkpoint ``step`` (it then parks at the hang step)."""
    ckpt = case["paths"].checkpoints / f"step-{step:06d}" / "diffpipe.json"
    _wait_for(lambda: ckpt.is_file() or run.proc.poll() is not None, f"checkpoint {ckpt}")
    assert ckpt.is_file(), run.out.read_text(errors="replace")[-3000:]
    time.sleep(1)


def _kill_all(root: Path) -> None:
    for pid in _alive(root):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _wait_for(lambda: not _alive(root), "the killed processes to go", timeout=60)


def _snakemake_locks(case) -> list[Path]:
    locks = case["work"] / ".snakemake" / "locks"
    return sorted(locks.iterdir()) if locks.is_dir() else []


def _train_log(case) -> str:
    log = case["paths"].root / "logs" / "train.log"
    return log.read_text(errors="replace") if log.is_file() else ""


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("interrupts")
    work = root / f"work {NAME}"
    work.mkdir(parents=True)
    data = root / f"data {NAME}"
    write_demo_dataset(data, n=8, size=32)
    config = root / f"c {NAME}.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(yaml.safe_dump({
        "output_dir": f"run {NAME}",
        "datasets": [{"name": "d", "path": str(data), "resolution": 32}],
        "cache": {"shards": 1},
        # 2 steps per epoch, 8 in all; keep every checkpoint so each resume point stays visible
        "train": {"epochs": 4, "batch_size": 4, "lora": {"rank": 4, "alpha": 4}, "checkpoint_every_steps": 2,
                  "keep_checkpoints": 0},
    }))
    yield {"root": root, "work": work, "config": config, "paths": RunPaths(work / f"run {NAME}"), "runs": 0}
    _kill_all(root)


def test_kill_9_of_diffpipe_alone_keeps_the_run_locked(case):
    """Its Snakemake and jobs run on: a second run on the folder is refused, even once Snakemake is gone too."""
    first = Run(case, hang=5)
    try:
        _parked(case, 4, first)
        os.kill(first.pid, signal.SIGKILL)
        first.finish(timeout=60)
        rc, err = Run(case, hang=None).finish(timeout=300)
        assert rc == 1 and "in use by a diffpipe run" in err, err[-3000:]
        assert "Traceback" not in err
        # Snakemake killed as well: the train job alone still holds the run.
        for pid in _alive(case["root"]):
            if b"snakemake" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
        time.sleep(1)
        assert _alive(case["root"]), "the train job should still be running"
        rc, err = Run(case, hang=None).finish(timeout=300)
        assert rc == 1 and "still running" in err, err[-3000:]
    finally:
        _kill_all(case["root"])


@pytest.mark.parametrize(("sig", "resumed", "hang"), [(signal.SIGINT, 4, 7), (signal.SIGTERM, 6, 7)])
def test_signal_stops_every_job_and_the_next_run_resumes(case, sig, resumed, hang):
    """The run after a kill -9 clears Snakemake's stale lock and resumes; a signal then stops it cleanly."""
    run = Run(case, hang=hang)
    _wait_for(lambda: STEP.format(resumed) in _train_log(case) or run.proc.poll() is not None, "the train job")
    assert STEP.format(resumed) in _train_log(case), run.out.read_text(errors="replace")[-3000:]
    kept = {p.name for p in case["paths"].checkpoints.glob("step-*")}
    assert {f"step-{s:06d}" for s in range(2, resumed + 1, 2)} <= kept, f"checkpoints pruned: {kept}"
    _parked(case, 6, run)
    os.killpg(run.pid, sig)  # what Ctrl-C does: the signal to the shell's foreground process group
    sent = time.monotonic()
    rc, err = run.finish(timeout=120)
    took = time.monotonic() - sent
    left = _alive(case["root"])
    assert not left, f"processes of the run outlived diffpipe: {left}"
    assert rc == 128 + sig, err[-3000:]
    assert took < 60, took
    assert not _snakemake_locks(case), "Snakemake's lock outlived the run"
    assert "Traceback" not in err, err[-3000:]
    if sig == signal.SIGINT:  # the first run after the kill -9s: it said what it cleared
        assert "diffpipe run: removed Snakemake's lock left by an interrupted run" in err, err[-3000:]
    print(f"{signal.Signals(sig).name}: diffpipe run returned {took:.1f} s later, no process of the run left")


def test_plain_run_resumes_and_finishes(case):
    rc, err = Run(case, hang=None).finish(timeout=600)
    assert rc == 0, err[-3000:]
    assert STEP.format(6) in _train_log(case)
    assert "--unlock" not in err and "LockException" not in err
    assert case["paths"].adapter_file.is_file()
    assert (case["paths"].checkpoints / "step-000008" / "diffpipe.json").is_file()
    # The loss history of the interrupted runs survives Snakemake deleting the job's outputs.
    rows = [json.loads(line) for line in case["paths"].metrics.read_text().splitlines() if line.strip()]
    assert sorted({r["step"] for r in rows}) == list(range(1, 9)), rows
    assert not list(case["root"].rglob("PWNED"))
