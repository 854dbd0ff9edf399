"""Live progress (diffpipe/progress.py): the status file a job writes, its plain log lines, the rate and ETA
maths, `diffpipe status`, and `diffpipe run`'s live display of the files (issue #41: "Live progress")."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time

import pytest
from rich.console import Console
from typer.testing import CliRunner

from diffpipe import progress, runproc
from diffpipe.cli import app
from diffpipe.progress import JobState, Progress
from diffpipe.runner import LiveJobs, render_jobs, show_live


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _writer(tmp_path, clock, lines, **kw) -> Progress:
    kw = {"stage": "train", "total": 12, "display": "plain", "every_s": 5.0, "log": lines.append, "clock": clock,
          "samples_per_unit": 4, **kw}
    return Progress(tmp_path, "train", **kw)


def _state(tmp_path, job="train") -> dict:
    return json.loads((tmp_path / "progress" / f"{job}.json").read_text())


def test_rate_eta_and_their_text():
    assert progress.window_rate([(0.0, 0), (2.0, 10)]) == 5.0
    assert progress.window_rate([(0.0, 3)]) is None  # no time passed yet
    assert progress.eta_seconds(10, 30, 5.0) == 4.0
    assert progress.eta_seconds(30, 30, None) == 0.0 and progress.eta_seconds(1, 30, None) is None
    assert progress.duration(3723.4) == "1:02:03" and progress.duration(13) == "0:00:13"
    assert progress.rate_text(3.1, "step") == "3.10 it/s" and progress.rate_text(0.25, "step") == "4.0 s/it"
    assert progress.rate_text(25, "item") == "25.0 items/s"


def test_rate_is_measured_over_recent_updates_not_since_the_start(tmp_path):
    clock, lines = Clock(), []
    p = _writer(tmp_path, clock, lines, total=200)
    clock.t += 100  # a slow start (setup, compile) ...
    p.update(1)
    for _ in range(40):  # ... then 2 steps a second
        clock.t += 0.5
        p.update(p.state.done + 1)
    assert p.state.rate == pytest.approx(2.0)
    assert p.state.samples_rate == pytest.approx(8.0)
    assert p.state.eta == pytest.approx((200 - 41) / 2.0)


def test_status_file_is_throttled_and_final_step_always_written(tmp_path):
    clock, lines = Clock(), []
    p = _writer(tmp_path, clock, lines, total=3)
    assert _state(tmp_path)["done"] == 0 and _state(tmp_path)["state"] == "running"
    clock.t += 0.2
    p.update(1, loss=0.5)
    assert _state(tmp_path)["done"] == 0  # within MIN_INTERVAL_S of the last write
    clock.t += progress.MIN_INTERVAL_S
    p.update(2, loss=0.4)
    assert _state(tmp_path)["done"] == 2
    clock.t += 0.1
    p.update(3, loss=0.3)  # the last step: written at once
    state = _state(tmp_path)
    assert state["done"] == state["total"] == 3
    assert state["pid"] == os.getpid() and state["host"] == socket.gethostname()
    p.close()
    assert _state(tmp_path)["state"] == "finished"
    assert sorted(f.name for f in (tmp_path / "progress").iterdir()) == ["train.json"]  # no temporary file left


def test_plain_lines_every_n_seconds_and_at_the_end(tmp_path):
    clock, lines = Clock(), []
    p = _writer(tmp_path, clock, lines)
    for step in range(1, 13):
        clock.t += 1
        p.update(step, loss=1.0)
    assert [line.split(",")[0] for line in lines] == ["train: step 1/12 (8%)", "train: step 6/12 (50%)",
                                                      "train: step 11/12 (92%)", "train: step 12/12 (100%)"]
    assert "1.00 it/s" in lines[1] and "4.0 samples/s" in lines[1] and "ETA 0:00:06" in lines[1]
    assert "ETA" not in lines[-1]
    assert "GPU" not in lines[-1]  # none reported (CPU)


def test_loss_is_a_bias_corrected_average_that_skips_non_finite_steps(tmp_path):
    clock, lines = Clock(), []
    p = _writer(tmp_path, clock, lines)
    p.update(1, loss=2.0)
    assert p.state.loss_ema == pytest.approx(2.0)  # not 0.2: corrected for the zero start
    p.update(2, loss=math.nan)
    assert p.state.loss_ema == pytest.approx(2.0)
    p.update(3, loss=1.0, last_eval=0.7, gpu_mem_mb=2048)
    assert p.state.loss_ema == pytest.approx((0.9 * 0.1 * 2.0 + 0.1 * 1.0) / (1 - 0.9**2))
    assert "eval 0.7000" in p.state.describe() and "GPU 2.0 GiB" in p.state.describe()


def test_an_exception_records_the_job_failed(tmp_path):
    with pytest.raises(RuntimeError), _writer(tmp_path, Clock(), []) as p:
        p.update(1)
        raise RuntimeError("boom")
    assert _state(tmp_path)["state"] == "failed"


def test_quiet_hides_the_lines_but_writes_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFPIPE_QUIET", "1")
    clock, lines = Clock(), []
    p = _writer(tmp_path, clock, lines, display="auto")
    p.update(12)
    assert lines == [] and _state(tmp_path)["done"] == 12


def test_interval_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(progress.SECONDS_ENV, "0")
    lines = []
    p = Progress(tmp_path, "train", stage="train", total=5, display="plain", log=lines.append)
    for step in range(1, 4):
        p.update(step)
    assert len(lines) == 3


def test_an_unwritable_run_folder_does_not_stop_the_job(tmp_path):
    (tmp_path / "progress").write_text("a file where the folder would be")
    p = _writer(tmp_path, Clock(), [])
    p.update(12)
    p.close()


def test_a_job_named_by_the_cli_writes_its_file(tmp_path):
    with progress.job(tmp_path, "cache_latents-s0003", stage="cache latents", shard="s0003"):
        with progress.start(4, unit="item", stage="ignored", log=lambda _: None) as p:
            p.update(4)
    state = _state(tmp_path, "cache_latents-s0003")
    assert (state["stage"], state["shard"], state["done"], state["total"], state["unit"], state["state"]) == (
        "cache latents", "s0003", 4, 4, "item", "finished")
    assert not (tmp_path / "progress" / "ignored.json").exists()
    # No job named: shown only, no file.
    with progress.start(2, unit="item", stage="cache text", log=lambda _: None) as p:
        p.update(2)
    assert sorted(f.name for f in (tmp_path / "progress").iterdir()) == ["cache_latents-s0003.json"]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _fake(root, job, *, now, **kw) -> JobState:
    state = JobState(job, kw.pop("stage", "train"), kw.pop("done", 40), kw.pop("total", 80), now - 100,
                     kw.pop("updated", now - 1), pid=kw.pop("pid", os.getpid()), host=kw.pop("host", socket.gethostname()),
                     **kw)
    (root / "progress").mkdir(parents=True, exist_ok=True)
    (root / "progress" / f"{job}.json").write_text(json.dumps(state.__dict__))
    return state


def test_conditions(tmp_path):
    now = time.time()
    assert _fake(tmp_path, "a", now=now).condition(now) == "running"
    assert _fake(tmp_path, "b", now=now, pid=_dead_pid()).condition(now) == "stale"  # killed: never wrote its end
    assert _fake(tmp_path, "c", now=now, state="finished").condition(now) == "finished"
    assert _fake(tmp_path, "d", now=now, host="node-7", pid=1).condition(now) == "running"
    old = now - progress.STALE_AFTER_S - 1
    assert _fake(tmp_path, "e", now=now, host="node-7", updated=old).condition(now) == "stale"


def test_status_command_reads_the_files(tmp_path):
    now = time.time()
    _fake(tmp_path, "train", now=now, loss_ema=0.5123, rate=3.1, samples_rate=12.4, eta=13.0)
    _fake(tmp_path, "cache_latents-s0000", now=now, stage="cache latents", shard="s0000", unit="item", done=16,
          total=16, state="finished", rate=25.0)
    (tmp_path / "progress" / "broken.json").write_text("{half a fi")
    result = CliRunner().invoke(app, ["status", str(tmp_path)])
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 2
    train = next(line for line in lines if line.startswith("train"))
    assert "running" in train and "step 40/80 (50%), loss 0.5123, 3.10 it/s, 12.4 samples/s, ETA 0:00:13" in train
    cache = next(line for line in lines if line.startswith("cache latents s0000"))
    assert "finished" in cache and "16/16 items (100%)" in cache


def test_status_command_without_progress_and_without_arguments(tmp_path):
    result = CliRunner().invoke(app, ["status", str(tmp_path)])
    assert result.exit_code == 0 and "no job has reported progress" in result.stderr
    assert CliRunner().invoke(app, ["status"]).exit_code == 2


def test_live_display_shows_this_runs_running_jobs(tmp_path):
    now = time.time()
    _fake(tmp_path, "train", now=now, loss_ema=0.5123, rate=3.1, eta=13.0)
    _fake(tmp_path, "cache_text-s0000", now=now, stage="cache text", shard="s0000", unit="caption", state="finished")
    _fake(tmp_path, "cache_latents-s0001", now=now, stage="cache latents", shard="s0001", updated=now - 3600)
    _fake(tmp_path, "cache_latents-s0002", now=now, stage="cache latents", shard="s0002", unit="item", done=3,
          total=8, rate=25.0)
    console = Console(record=True, force_terminal=True, width=160)
    view = LiveJobs(console, tmp_path, since=now - 60)
    console.print(view.render())
    text = console.export_text()
    assert "train" in text and "step 40/80 (50%), loss 0.5123, 3.10 it/s, ETA 0:00:13" in text
    assert "cache latents s0002" in text and "3/8 items (38%), 25.0 items/s" in text
    assert "s0001" not in text  # an earlier run's
    assert "cache text" not in text  # finished


def test_live_display_prints_snakemake_lines_above_itself(tmp_path):
    now = time.time()
    _fake(tmp_path, "train", now=now)
    console = Console(record=True, force_terminal=True, force_interactive=True, width=120)
    with LiveJobs(console, tmp_path, since=now - 60) as view:
        view.print("localrule train:")
        view.live.refresh()
    text = console.export_text()
    assert "localrule train:" in text and "step 40/80" in text


def test_render_jobs_empty_and_when_shown():
    assert Console(record=True).export_text() == ""
    console = Console(record=True, width=80)
    console.print(render_jobs([]))
    assert console.export_text().strip() == ""
    terminal = Console(force_terminal=True, force_interactive=True)
    assert show_live(terminal) and not show_live(terminal, dry_run=True)
    assert not show_live(Console(file=open(os.devnull, "w"), force_terminal=False))  # noqa: SIM115


def test_quiet_hides_the_live_display(monkeypatch):
    monkeypatch.setenv("DIFFPIPE_QUIET", "1")
    assert not show_live(Console(force_terminal=True))


def test_run_group_hands_each_stderr_line_over(tmp_path, capfd):
    lines = []
    finished = runproc.run_group(["sh", "-c", "echo one >&2; echo out; echo two >&2; printf 'three' >&2"],
                                 env=dict(os.environ), cwd=tmp_path, output=lines.append)
    assert finished.returncode == 0
    assert lines == ["one", "two", "three"]
    assert capfd.readouterr().out == "out\n"  # stdout is left alone (`diffpipe run ... -- --list-rules > f`)


def test_a_store_inside_the_progress_folder_is_refused(tmp_path):
    from diffpipe.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=r"cache\.dir .* move it out of progress/"):
        parse_config({"output_dir": str(tmp_path / "run"), "datasets": [{"name": "d", "path": str(tmp_path / "d")}],
                      "cache": {"dir": str(tmp_path / "run" / "progress" / "store")}})
