"""train.mode: full fine-tunes every denoiser weight and writes a diffusers model folder."""

import pytest
import torch
from diffusers import UNet2DConditionModel
from stage_cli import in_process

from diffpipe.config import ModelConfig
from diffpipe.families import get_family
from diffpipe.paths import RunPaths
from diffpipe.training.checkpoint import adapter_from_checkpoint, list_checkpoints


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
