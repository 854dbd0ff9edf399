"""Runs shared by the multi-process tests: every process launch costs seconds of imports, so
each run trains once per session and serves several checks (offload, resume, references)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from diffpipe.paths import RunPaths
from diffpipe.training.checkpoint import list_checkpoints

# One eval quantile on 2 items: under ZeRO-3 every forward gathers the weights.
ZERO_TRAIN = {"epochs": 1, "batch_size": 2, "eval": {"quantiles": [0.5], "max_items": 2}}
# Offload rides on the ZeRO-2 and ZeRO-3 runs (it must not change the losses either);
# ZeRO-3 also checkpoints after its first step, for the resume test.
ZERO_EXTRA = {
    1: {},
    2: {"offload_optimizer": True},
    3: {"offload_optimizer": True, "offload_params": True, "checkpoint_every_steps": 1},
}


@pytest.fixture(scope="session")
def zero_run(tiny_run, cli, tmp_path_factory) -> Callable[[int], RunPaths]:
    """``zero_run(stage)``: the 2-process data-parallel run at that ZeRO stage (trained on first use)."""
    runs: dict[int, RunPaths] = {}

    def get(stage: int) -> RunPaths:
        if stage not in runs:
            root = tmp_path_factory.mktemp(f"zero{stage}")
            cfg = tiny_run.clone(root, zero_stage=stage, **ZERO_TRAIN, **ZERO_EXTRA[stage])
            result = cli("train", "-c", str(cfg), "--processes", "2")
            assert result.returncode == 0, result.stderr[-4000:]
            runs[stage] = RunPaths(root / "run")
        return runs[stage]

    return get


@pytest.fixture(scope="session")
def fork_at() -> Callable[..., tuple[Path, RunPaths]]:
    """``fork_at(run, step, dest, **train)``: a copy of ``run`` at ``dest``, stopped right after its
    checkpoint at ``step``, whose config may change resume-safe ``train`` keys.

    Later checkpoints, the final adapter and the summary go; the metrics keep their
    later rows (a killed run logs past its checkpoint), which the resume must cut.
    Returns the copy's config file (``output_dir`` differs too: a resume-safe key) and paths.
    """

    def fork(run: RunPaths, step: int, dest: Path, **train) -> tuple[Path, RunPaths]:
        shutil.copytree(run.root, dest / "run")
        paths = RunPaths(dest / "run")
        for ckpt in list_checkpoints(paths.checkpoints):
            if int(ckpt.name.removeprefix("step-")) > step:
                shutil.rmtree(ckpt)
        shutil.rmtree(paths.adapter_dir)
        (paths.train_dir / "summary.json").unlink()
        data = yaml.safe_load((run.root.parent / "config.yaml").read_text())  # written by TinyRun.clone
        data["output_dir"] = str(paths.root)
        data["train"].update(train)
        cfg = dest / "config.yaml"
        cfg.write_text(yaml.safe_dump(data))
        return cfg, paths

    return fork
