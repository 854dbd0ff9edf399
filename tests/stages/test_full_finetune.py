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
    step-4 checkpoint resumes from step 2 to the uninterrupted run's losses, weights and moments, bit for bit.

    The killed run is its own reference: it ran steps 1-4 uninterrupted, wrote each step's metrics row (flushed
    before the checkpoint starts) and its step-4 weights and moments (synced before the fault) into the
    checkpoint it never finished. A separate uninterrupted run would compile torchao's 8-bit step (a graph per
    parameter shape) once more and prove nothing more."""
    train = {"mode": "full", "max_steps": 4, "lr": 1e-4, "precision": "bf16", "optimizer": "adamw8bit",
             "optimizer_in_backward": True, "grad_clip": 0, "checkpoint_every_steps": 2, "keep_checkpoints": 0}
    cfg = tiny_run.clone(tmp_path, **train)
    paths = RunPaths(tmp_path / "run")
    killed = cli("train", "-c", str(cfg), env={"DIFFPIPE_FAULT": "checkpoint-write:4"})
    assert killed.returncode == 17, killed.stderr[-3000:]
    rows = read_metrics(paths.metrics)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["grad_norm"] > 0 for r in rows)  # the norm the hooks saw
    [step2] = list_checkpoints(paths.checkpoints)
    # The saved optimizer state holds the quantised moments themselves.
    assert "OptimState8bit" in [type(v).__name__ for v in _tensors(_checkpoint_state(step2))]
    unfinished = paths.checkpoints / ".tmp-step-000004"  # what the fault left: its state files complete
    want = _checkpoint_state(unfinished)

    resumed = in_process("train", "-c", str(cfg), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 2" in resumed.stdout + resumed.stderr
    assert [r["loss"] for r in read_metrics(paths.metrics)] == [r["loss"] for r in rows]
    have = _checkpoint_state(list_checkpoints(paths.checkpoints)[-1])
    assert list(want) == list(have)
    for name in want:  # weights, then every moment (its quantised codes and scales)
        pairs = list(zip(_tensors(want[name]), _tensors(have[name]), strict=True))
        assert pairs and all(_same(a, b) for a, b in pairs), name
    weights = UNet2DConditionModel.from_pretrained(paths.train_dir / "denoiser").state_dict()
    module = want["mp_rank_00_model_states.pt"]["module"]
    assert all(torch.equal(weights[k], module[k].to(weights[k].dtype)) for k in module)  # the export is those weights


def _checkpoint_state(folder):
    """The DeepSpeed state files of checkpoint ``folder`` (weights and optimizer state), by file name."""
    return {f.name: torch.load(f, weights_only=True) for f in sorted(folder.rglob("*.pt"))}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, through torchao's quantised-state subclass (its codes and scales) where it is one."""
    if hasattr(a, "__tensor_flatten__") and type(a) is not torch.Tensor:
        names, _ = a.__tensor_flatten__()
        return type(a) is type(b) and all(torch.equal(getattr(a, n), getattr(b, n)) for n in names)
    return torch.equal(a, b)


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
