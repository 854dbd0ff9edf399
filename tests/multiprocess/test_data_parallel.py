"""Data parallel on 2 CPU processes (gloo) standing in for 2 GPUs: ZeRO 1, 2 and 3, with CPU offload.

Each stage trains the tiny model for 2 steps through ``diffpipe train
--processes 2`` (our own launcher); ZeRO-2 offloads the optimizer states and
ZeRO-3 both optimizer states and parameters (see ``conftest.ZERO_EXTRA``).
The ranks must hold identical LoRA weights afterwards (the run's
``summary.json`` records the check, and what DeepSpeed's optimizer really
offloads), and neither sharding nor offload may change the math: every stage
gives the same losses. The ZeRO-3 run, resumed from its step-1 checkpoint,
repeats its step 2 exactly. The ZeRO-1 run is also the reference of the
hybrid run (2 pipeline stages x 2 data-parallel replicas on 4 processes).
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from diffpipe.paths import RunPaths
from diffpipe.training.adapter import load_adapter
from diffpipe.training.checkpoint import list_checkpoints
from diffpipe.training.metrics import read_metrics

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_process_zero_stage(stage, zero_run):
    paths = zero_run(stage)
    summary = json.loads((paths.train_dir / "summary.json").read_text())
    # Read back from DeepSpeed's ZeRO optimizer: fails if our config stops reaching it.
    offload = {"optimizer": stage >= 2, "params": stage == 3}
    assert summary == {**summary, "world_size": 2, "ranks_agree": True, "steps": 2, "offload": offload}
    ckpts = list_checkpoints(paths.checkpoints)
    assert [c.name for c in ckpts] == (["step-000001", "step-000002"] if stage == 3 else ["step-000002"])
    assert sorted(p.name for p in ckpts[-1].glob("rng-rank*")) == ["rng-rank000.safetensors", "rng-rank001.safetensors"]


def test_zero_stages_agree(zero_run):
    runs = {s: zero_run(s) for s in (1, 2, 3)}
    losses = {s: [r["loss"] for r in read_metrics(p.metrics)] for s, p in runs.items()}
    adapters = {s: load_adapter(p.adapter_dir)[0] for s, p in runs.items()}
    for s in (2, 3):
        assert losses[s] == pytest.approx(losses[1], abs=1e-5), (s, losses)
        for k, v in adapters[1].items():
            # Adam normalises tiny gradients, so reduction-order noise shows in the weights.
            torch.testing.assert_close(adapters[s][k], v, rtol=0, atol=5e-4)


def test_zero3_offload_resumes_exactly(zero_run, fork_at, cli, tmp_path):
    """Resume the ZeRO-3 + offload run from its step-1 checkpoint (mid-epoch): step 2 repeats bit for
    bit (same partitioned weights, optimizer states, RNG and data position; the same reductions)."""
    ref = zero_run(3)
    # No eval (a resume-safe key): DeepSpeed's ZeRO-3 prefetch bookkeeping makes the first eval
    # after a process's first step cost 5-10 s of CPU on 2 busy cores; eval under ZeRO-3 is scored
    # by the run itself.
    cfg, paths = fork_at(ref, 1, tmp_path, eval={"quantiles": []})
    result = cli("train", "-c", str(cfg), "--processes", "2", "--resume")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "resumed from step 1" in result.stdout + result.stderr
    summary = json.loads((paths.train_dir / "summary.json").read_text())
    offload = {"optimizer": True, "params": True}
    assert summary == {**summary, "resumed_from": 1, "ranks_agree": True, "offload": offload}
    want, got = read_metrics(ref.metrics), read_metrics(paths.metrics)
    assert [r["step"] for r in got] == [1, 2]
    for a, b in zip(want, got, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6, (a, b)
    assert abs(got[-1]["grad_norm"] - want[-1]["grad_norm"]) <= 1e-6
    a, b = load_adapter(ref.adapter_dir)[0], load_adapter(paths.adapter_dir)[0]
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6)
    assert [c.name for c in list_checkpoints(paths.checkpoints)] == ["step-000001", "step-000002"]


def test_hybrid_data_x_pipeline_matches_data_parallel(tiny_run, cli, zero_run, tmp_path):
    """4 processes = 2 pipeline stages x 2 data-parallel replicas, against the 2-process ZeRO-1 run.

    Same config except ``pipeline_stages`` (and ZeRO 0: the ZeRO stage does not change the math,
    see ``test_zero_stages_agree``; ZeRO 0 sends the replicas' gradients through DeepSpeed's plain
    all-reduce, which the ZeRO runs do not use). Replica r of the hybrid is rank r of the
    data-parallel run: the same micro-batches and the same noise generator (seeded by the replica),
    so the per-step losses and the gathered LoRA must agree up to summation order.
    """
    ref = zero_run(1)
    cfg = tiny_run.clone(tmp_path)  # the caches; the config is the reference's, but for:
    data = yaml.safe_load((ref.root.parent / "config.yaml").read_text())
    data["output_dir"] = str(tmp_path / "run")
    data["train"].update(pipeline_stages=2, zero_stage=0)
    cfg.write_text(yaml.safe_dump(data))
    result = cli("train", "-c", str(cfg), "--processes", "4")
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout + result.stderr
    # DeepSpeed's pipe x data grid: ranks 0-1 run stage 0, ranks 2-3 stage 1.
    assert "ProcessCoord(pipe=1, data=1): 3" in out, out[-3000:]
    paths = RunPaths(tmp_path / "run")
    summary = json.loads((paths.train_dir / "summary.json").read_text())
    # ranks_agree: each stage's 2 replicas hold bit-identical LoRA parts.
    assert summary == {**summary, "world_size": 4, "ranks_agree": True, "steps": 2}
    want, got = read_metrics(ref.metrics), read_metrics(paths.metrics)
    assert [r["step"] for r in got] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in got)
    assert got[0]["loss"] == pytest.approx(want[0]["loss"], abs=1e-6)  # same weights, data and noise
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], abs=1e-5)
    assert got[-1]["eval_loss"] == pytest.approx(want[-1]["eval_loss"], abs=1e-5)
    a, b = load_adapter(ref.adapter_dir)[0], load_adapter(paths.adapter_dir)[0]
    assert a.keys() == b.keys()  # the LoRA gathered from both stages is complete
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=5e-4)  # as between ZeRO stages
    # Reduction-order noise only: on this CPU about 1e-4 at most, 1e-7 on average.
    assert torch.cat([(b[k] - a[k]).abs().flatten() for k in a]).mean() < 1e-5
