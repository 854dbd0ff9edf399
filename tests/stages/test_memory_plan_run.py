"""``train.memory: auto`` end to end on the tiny model: the plan is the first row of ``metrics.jsonl``, in
``summary.json``, and a section of the exported model card."""

from __future__ import annotations

import json

import pytest
from stage_cli import in_process

from diffpipe.paths import RunPaths
from diffpipe.training.metrics import read_metrics

pytestmark = pytest.mark.slow


def test_the_plan_is_recorded_in_metrics_summary_and_card(tiny_run, tmp_path):
    # 80 GiB: the tiny SD (sized as SD 1.5) trains in bf16 without checkpointing, as it does by default.
    cfg = tiny_run.clone(tmp_path, max_steps=2, memory="auto", gpu_memory=80, eval={"quantiles": []})
    result = in_process("train", "-c", str(cfg))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "train: memory plan: chosen: base_weights bf16" in result.stderr + result.stdout
    paths = RunPaths(tmp_path / "run")
    first, *steps = read_metrics(paths.metrics)
    plan = first["memory_plan"]
    assert first["step"] == 0 and plan["chosen"]["base_weights"] == "auto" and plan["gpu_bytes"] == 80 * 2**30
    assert [r["step"] for r in steps] == [1, 2] and all("memory_plan" not in r for r in steps)
    assert json.loads((paths.train_dir / "summary.json").read_text())["memory_plan"] == plan
    result = in_process("export", "-c", str(cfg))
    assert result.returncode == 0, result.stderr[-3000:]
    card = (paths.export_dir / "README.md").read_text()
    assert "## Memory plan" in card and "for a 80.0 GiB GPU" in card
    assert "- chosen: base_weights bf16, activation_checkpointing off, block_swap 0" in card
    assert "- runner-up: " in card
