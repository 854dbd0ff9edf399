"""Pipeline parallel on CPU processes: a 2-stage pipeline reproduces a 1-process run of the same
config, resumes exactly, and trains in bf16. Its combination with data parallel (2 stages x 2
replicas on 4 processes) is in test_data_parallel.py, beside the ZeRO-1 run it is compared with:
that run then trains once per worker, not once in each of the two files.

Stage 0 and the last stage draw the same timesteps and noise (same generator
state), so the per-step losses and the gathered LoRA equal the plain run's
up to float summation order.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from stage_cli import in_process

from diffpipe.paths import RunPaths
from diffpipe.training.adapter import load_adapter
from diffpipe.training.checkpoint import list_checkpoints
from diffpipe.training.metrics import read_metrics

pytestmark = pytest.mark.multiprocess
TRAIN = {"grad_accum": 2, "epochs": 2, "lora": {"rank": 4, "alpha": 8}}


@pytest.fixture(scope="module")
def runs(tiny_run, cli, tmp_path_factory) -> dict[int, RunPaths]:
    """The 1-process run and the 2-stage pipeline (which also checkpoints mid-epoch, at step 3 of 4).

    The 1-process run trains in this process (``in_process``: the real Typer app, no interpreter start-up);
    the pipeline's 2 ranks are processes of their own, started by our launcher."""
    out = {}
    for stages, extra in [(1, {}), (2, {"checkpoint_every_steps": 3})]:
        root = tmp_path_factory.mktemp(f"pp{stages}")
        cfg = tiny_run.clone(root, pipeline_stages=stages, **TRAIN, **extra)
        args = ("train", "-c", str(cfg))
        result = in_process(*args) if stages == 1 else cli(*args, "--processes", "2")
        assert result.returncode == 0, result.stderr[-4000:]
        out[stages] = RunPaths(root / "run")
    return out


def test_two_stage_pipeline_matches_one_process(runs):
    pp = runs[2]
    summary = json.loads((pp.train_dir / "summary.json").read_text())
    assert summary["ranks_agree"] and summary["world_size"] == 2
    want = [r["loss"] for r in read_metrics(runs[1].metrics)]
    got = [r["loss"] for r in read_metrics(pp.metrics)]
    assert got[0] == pytest.approx(want[0], abs=1e-6)  # the same weights, noise and timesteps
    # Later steps: gradient accumulation sums in another order; Adam magnifies that a little.
    assert got == pytest.approx(want, abs=2e-4)
    a, b = load_adapter(runs[1].adapter_dir)[0], load_adapter(pp.adapter_dir)[0]
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=2e-3)
    # Adam's first update is lr * sign(g), the same; later ones magnify float-order noise
    # in near-zero gradients: small next to the updates themselves (about 4 steps x lr = 4e-3).
    diffs = torch.cat([(b[k] - a[k]).abs().flatten() for k in a])
    assert diffs.mean() < 1e-4, diffs.mean()
    # The eval loss goes through the pipeline too (eval_batch), with the same fixed noise.
    want_eval, got_eval = read_metrics(runs[1].metrics)[-1], read_metrics(pp.metrics)[-1]
    for q in ("eval_loss_q0.1", "eval_loss_q0.9", "eval_loss"):
        assert got_eval[q] == pytest.approx(want_eval[q], abs=1e-3)
    ckpts = list_checkpoints(pp.checkpoints)
    assert [c.name for c in ckpts] == ["step-000003", "step-000004"]
    assert (ckpts[-1] / "adapter").is_dir() and len(list(ckpts[-1].glob("layer_*-model_states.pt"))) == 7


def test_pipeline_resumes_exactly(runs, fork_at, cli, tmp_path):
    """Resumed from the step-3 checkpoint (mid-epoch), step 4 repeats the uninterrupted pipeline run
    bit for bit (each stage reloads its own layers, optimizer and RNG; both replay the same noise)."""
    ref = runs[2]
    cfg, paths = fork_at(ref, 3, tmp_path)
    result = cli("train", "-c", str(cfg), "--processes", "2", "--resume")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "resumed from step 3" in result.stdout + result.stderr
    summary = json.loads((paths.train_dir / "summary.json").read_text())
    assert summary == {**summary, "resumed_from": 3, "ranks_agree": True, "steps": 4}
    want, got = read_metrics(ref.metrics), read_metrics(paths.metrics)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for a, b in zip(want, got, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6, (a, b)
        assert a["lr"] == b["lr"]
    assert abs(want[-1]["eval_loss"] - got[-1]["eval_loss"]) <= 1e-6
    a, b = load_adapter(ref.adapter_dir)[0], load_adapter(paths.adapter_dir)[0]
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6)


def test_bf16_pipeline_trains_and_starts_from_the_one_process_loss(runs, tiny_run, cli, tmp_path):
    """Under train.precision bf16 the stages' inputs are cast to the stage weights' dtype (they were float32,
    which the first layer refused), so a 2-stage bf16 run trains, and its first loss is the 1-process run's
    up to bf16 rounding: the fp32 reference above draws the same micro-batches, timesteps and noise (the
    LoRA starts as the identity), so no separate 1-process bf16 run (a process launch) is needed."""
    cfg = tiny_run.clone(tmp_path, pipeline_stages=2, precision="bf16", max_steps=2, **TRAIN)
    result = cli("train", "-c", str(cfg), "--processes", "2")
    assert result.returncode == 0, result.stderr[-4000:]
    got = [r["loss"] for r in read_metrics(RunPaths(tmp_path / "run").metrics)]
    want = [r["loss"] for r in read_metrics(runs[1].metrics)]
    assert len(got) == 2 and all(math.isfinite(x) for x in got)
    assert got[0] == pytest.approx(want[0], abs=1e-3)  # measured: 1.8e-5 apart
    assert got[0] != want[0]  # it really ran in bf16
