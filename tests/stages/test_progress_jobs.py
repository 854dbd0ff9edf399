"""Live progress from real jobs (issue #41): a tiny `diffpipe train` and a latent cache job write their status
files and plain progress lines (a log is not a terminal), and `diffpipe status` reads them back."""

from __future__ import annotations

import json

from stage_cli import in_process

FAST_LINES = {"DIFFPIPE_PROGRESS_SECONDS": "0"}  # a line per update: the test sees every step


def _status(run_dir) -> list[str]:
    result = in_process("status", str(run_dir))
    assert result.returncode == 0, result.stderr
    return result.stderr.splitlines()


def test_training_reports_each_step_and_ends_at_total(tiny_run, tmp_path):
    cfg = tiny_run.clone(tmp_path, max_steps=3, eval={"every_steps": 2})
    result = in_process("train", "-c", str(cfg), env=FAST_LINES)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("train: step ")]
    assert [line.split(",")[0] for line in lines] == ["train: step 1/3 (33%)", "train: step 2/3 (67%)",
                                                      "train: step 3/3 (100%)"]
    assert all("loss " in line and "samples/s" in line for line in lines[1:])
    assert "eval " in lines[-1]
    assert "ETA 0:" in lines[1]
    assert any(" steps in " in line for line in result.stderr.splitlines())  # the summary line stays
    state = json.loads((tmp_path / "run" / "progress" / "train.json").read_text())
    assert (state["done"], state["total"], state["state"], state["unit"]) == (3, 3, "finished", "step")
    assert state["loss_ema"] > 0 and state["last_eval"] > 0 and state["gpu_mem_mb"] is None  # CPU: no GPU figure
    (line,) = _status(tmp_path / "run")
    assert line.startswith("train") and "finished" in line and "step 3/3 (100%)" in line


def test_cache_job_reports_items_of_its_shard(tiny_run, tmp_path):
    cfg = tiny_run.clone(tmp_path)
    result = in_process("cache", "latents", "-c", str(cfg), "--shard", "s0000", "--regenerate", env=FAST_LINES)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("cache latents s0000: ")
             and " items (" in line]  # not the job's summary line
    assert lines and lines[-1].startswith("cache latents s0000: 8/8 items (100%), ")
    state = json.loads((tmp_path / "run" / "progress" / "cache_latents-s0000.json").read_text())
    assert (state["done"], state["total"], state["state"], state["shard"]) == (8, 8, "finished", "s0000")
    assert any(line.startswith("cache latents s0000") and "finished" in line for line in _status(tmp_path / "run"))
