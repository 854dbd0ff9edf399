"""train.mode: full fine-tunes every denoiser weight and writes a diffusers model folder."""

import pytest
import torch
from diffusers import UNet2DConditionModel
from stage_cli import in_process

from diffpipe.config import ModelConfig
from diffpipe.families import get_family
from diffpipe.paths import RunPaths
from diffpipe.training.checkpoint import adapter_from_checkpoint, list_checkpoints
from diffpipe.training.metrics import read_metrics


def test_full_fine_tune(tiny_run, tmp_path):
    cfg = tiny_run.clone(tmp_path, mode="full", max_steps=2, lr=1e-4, precision="bf16")
    result = in_process("train", "-c", str(cfg))
    assert result.returncode == 0, result.stderr[-3000:]
    paths = RunPaths(tmp_path / "run")
    tuned = UNet2DConditionModel.from_pretrained(paths.train_dir / "denoiser")
    base = get_family(ModelConfig()).load_denoiser()
    changed = [k for k, v in base.state_dict().items() if not torch.equal(v, tuned.state_dict()[k].float())]
    assert len(changed) > 0.75 * len(base.state_dict())  # the weights themselves train (some get no gradient)
    assert not paths.adapter_dir.exists()
    with pytest.raises(ValueError, match="holds no LoRA"):
        adapter_from_checkpoint(list_checkpoints(paths.checkpoints)[-1], tmp_path / "x")


def test_full_fine_tune_8bit_in_backward_resumes_exactly(tiny_run, cli, tmp_path):
    """adamw8bit moments (quantised) stepped in the backward pass under bf16: a run killed while writing its
    step-4 checkpoint resumes from step 2 to the uninterrupted run's losses and weights, bit for bit."""
    train = {"mode": "full", "max_steps": 4, "lr": 1e-4, "precision": "bf16", "optimizer": "adamw8bit",
             "optimizer_in_backward": True, "grad_clip": 0, "checkpoint_every_steps": 2, "keep_checkpoints": 0}
    ref_cfg = tiny_run.clone(tmp_path / "ref", **train)
    result = in_process("train", "-c", str(ref_cfg))
    assert result.returncode == 0, result.stderr[-3000:]
    ref = RunPaths(tmp_path / "ref" / "run")
    rows = read_metrics(ref.metrics)
    assert all(r["grad_norm"] > 0 for r in rows)  # the norm the hooks saw
    # The saved optimizer state holds the quantised moments themselves.
    states = [f for f in (list_checkpoints(ref.checkpoints)[0]).rglob("*.pt") if "optim" in f.name or "model" in f.name]
    found = [type(v).__name__ for f in states for v in _tensors(torch.load(f, weights_only=True))]
    assert "OptimState8bit" in found

    cfg = tiny_run.clone(tmp_path / "killed", **train)
    paths = RunPaths(tmp_path / "killed" / "run")
    killed = cli("train", "-c", str(cfg), env={"DIFFPIPE_FAULT": "checkpoint-write:4"})
    assert killed.returncode == 17, killed.stderr[-3000:]
    resumed = in_process("train", "-c", str(cfg), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 2" in resumed.stdout + resumed.stderr
    assert [r["loss"] for r in read_metrics(paths.metrics)] == [r["loss"] for r in rows]
    want = UNet2DConditionModel.from_pretrained(ref.train_dir / "denoiser").state_dict()
    have = UNet2DConditionModel.from_pretrained(paths.train_dir / "denoiser").state_dict()
    assert all(torch.equal(want[k], have[k]) for k in want)


def _tensors(value):
    """Every tensor in a nested checkpoint value."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _tensors(v)
