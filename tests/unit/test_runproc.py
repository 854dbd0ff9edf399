"""diffpipe.runproc: a run's process group stops and ends as one; Snakemake's stale lock of this run goes (#38)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from diffpipe import runproc


def _gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        if open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] != "Z":
            return False
    return True


def _read_pids(tmp_path) -> list[str]:
    try:
        return (tmp_path / "pids").read_text().split()
    except FileNotFoundError:
        return []


def _sleepers(tmp_path) -> list[int]:
    return [int(p) for p in (tmp_path / "pids").read_text().split()]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_every_process_of_the_group(tmp_path, monkeypatch, sig):
    monkeypatch.setattr(runproc, "GRACE_S", 2.0)
    # As from a terminal: the signal has its default action here. A test worker may have been started with
    # it ignored, and run_group rightly leaves an ignored signal ignored (the nohup test below).
    default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
    old = signal.signal(sig, default)
    said = []
    # The shell ignores nothing; its background sleeps ignore SIGINT (as a non-interactive shell's do):
    # the grace period ends them.
    script = f"sleep 300 & echo $! > {tmp_path}/pids; sleep 300 & echo $! >> {tmp_path}/pids; wait"
    def signal_once_started():  # after the group's processes exist, however loaded the machine is
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(_read_pids(tmp_path)) < 2:
            time.sleep(0.05)
        time.sleep(0.3)
        os.kill(os.getpid(), sig)

    threading.Thread(target=signal_once_started, daemon=True).start()
    start = time.monotonic()
    try:
        done = runproc.run_group(["bash", "-c", script], env=dict(os.environ), cwd=tmp_path, say=said.append)
    finally:
        signal.signal(sig, old)
    assert done.signal == sig and time.monotonic() - start < 15
    assert _gone(_sleepers(tmp_path))
    assert any(signal.Signals(sig).name in line for line in said), said


def test_a_signal_ignored_by_diffpipe_run_stays_ignored(tmp_path):
    """`nohup diffpipe run &`: closing the terminal does not stop the run."""
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGHUP)).start()
        done = runproc.run_group(["sleep", "1.5"], env=dict(os.environ), cwd=tmp_path)
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, old)
    assert done.signal is None and done.returncode == 0


def test_processes_left_by_an_ended_leader_are_stopped(tmp_path):
    said = []
    # Children that outlive their parent, as jobs outlive a killed Snakemake.
    code = (f"import subprocess\nwith open({str(tmp_path / 'pids')!r}, 'w') as f:\n"
            "    for _ in range(2): f.write(f\"{subprocess.Popen(['sleep', '300']).pid} \")\n")
    start = time.monotonic()
    done = runproc.run_group([sys.executable, "-c", code], env=dict(os.environ), cwd=tmp_path, say=said.append)
    assert done.returncode == 0 and done.signal is None and time.monotonic() - start < 15
    assert _gone(_sleepers(tmp_path))
    assert any("ended before all its jobs" in line for line in said), said


def test_only_this_run_folders_stale_snakemake_lock_is_removed(tmp_path):
    work = tmp_path / "work"
    locks = work / ".snakemake" / "locks"
    locks.mkdir(parents=True)
    ours = "run 'q'\nnl"  # a newline splits the name over two lines of the lock file
    (locks / "0.input.lock").write_text(f"/data/a.png\n{ours}/plan/plan.json\n")
    (locks / "0.output.lock").write_text(f"{ours}/train/metrics.jsonl\n{ours}/validate.json\n")
    (locks / "1.output.lock").write_text("run 'q'\nnl2/train/metrics.jsonl\n")  # another run folder: alive, maybe
    (locks / "2.output.lock").write_text(f"{work / ours}/export/x.safetensors\n")  # ours, absolute
    removed = runproc.clear_stale_snakemake_lock(work, work / ours)
    assert [p.name for p in removed] == ["0.input.lock", "0.output.lock", "2.output.lock"]
    assert sorted(p.name for p in locks.iterdir()) == ["1.output.lock"]
    assert runproc.clear_stale_snakemake_lock(tmp_path / "none", work / ours) == []


def test_a_job_of_a_run_keeps_the_run_folder_locked_after_its_snakemake_is_gone(tmp_path, monkeypatch):
    from diffpipe import runlock

    run = tmp_path / "run"
    runlock.check_no_jobs(run)  # no lock file yet
    with runlock.hold(run, runlock.RUN_LOCK, "diffpipe run") as held:
        assert runlock.held_fd(held) is not None
        monkeypatch.setenv(runlock.HELD_ENV, runlock.held_env(held))
        runlock.join_run()  # what each job's `diffpipe` does first
    assert runlock.held_fd(held) is None
    monkeypatch.delenv(runlock.HELD_ENV)
    try:
        with pytest.raises(runlock.FolderLocked, match="a job of an earlier diffpipe run on it is still running"):
            runlock.check_no_jobs(run)
        with pytest.raises(runlock.FolderLocked, match="still running"):
            runlock.check_free(run, runlock.RUN_LOCK, "diffpipe run")  # a direct `diffpipe train` asks this
    finally:
        while runlock._JOINED:
            os.close(runlock._JOINED.pop())
    runlock.check_no_jobs(run)
    runlock.check_free(run, runlock.RUN_LOCK, "diffpipe run")


def test_regenerate_options_come_before_the_targets(tmp_path, monkeypatch):
    """`run --regenerate --target X`: --forcerun and its rules are options, not more targets after "--"."""
    import yaml

    from diffpipe import runner

    seen = {}

    def started(cmd, **kwargs):
        seen["cmd"] = cmd
        raise RuntimeError("stop here")

    monkeypatch.setattr(runner.runproc, "run_group", started)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "run"), "datasets": [{"name": "d", "path": "d"}]}))
    with pytest.raises(RuntimeError, match="stop here"):
        runner.run_workflow(config, workdir=tmp_path, targets=["plan"], regenerate=True)
    cmd = seen["cmd"]
    assert cmd[cmd.index("--") + 1:] == ["plan"]
    assert cmd.index("--forcerun") < cmd.index("--")
