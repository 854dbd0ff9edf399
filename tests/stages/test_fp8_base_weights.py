"""``train.base_weights: fp8`` on CPU: float8 storage of the frozen denoiser, LoRA untouched, exact resume."""

from __future__ import annotations

import re

import peft
import pytest
import torch

from diffpipe.config import ModelConfig, TrainConfig
from diffpipe.models import get_family
from diffpipe.paths import RunPaths
from diffpipe.training import adapter, precision
from diffpipe.training.metrics import read_metrics

# diffusers' DEFAULT_SKIP_MODULES_PATTERN (0.42.1): layers layerwise casting leaves alone.
SKIPPED = ("pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$")
TRAIN = {"precision": "bf16", "max_steps": 3, "checkpoint_every_steps": 1, "keep_checkpoints": 0}


def test_fp8_stores_frozen_weights_in_float8_and_keeps_the_lora():
    family = get_family(ModelConfig(family="sd"))
    unet = family.load_denoiser()
    lora = adapter.add_lora(unet, peft.LoraConfig(r=4, lora_alpha=4, target_modules=family.lora_targets(None)))
    precision.prepare_denoiser(unet, TrainConfig(precision="bf16", base_weights="fp8"))
    cast = convs = 0
    for name, module in unet.named_modules():
        if "lora_" in name or not isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
            continue
        if isinstance(module, torch.nn.Conv2d) or any(re.search(p, name) for p in SKIPPED):
            assert module.weight.dtype != torch.float8_e4m3fn, name
            convs += isinstance(module, torch.nn.Conv2d)
        else:
            assert module.weight.dtype == torch.float8_e4m3fn, f"{name}: {module.weight.dtype}"
            cast += 1
    assert cast > 10 and convs > 10
    assert all(p.requires_grad and p.dtype == torch.float32 for p in lora)
    assert {n for n, p in unet.named_parameters() if p.requires_grad} == {n for n, _ in unet.named_parameters()
                                                                          if "lora_" in n}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_fp8_unet_steps_with_and_without_checkpointing(checkpointing):
    """A convolution saves its weight tensor itself for backward; were it float8-stored, the casting hook
    would hand the backward (or the recomputation) float8. Convolutions stay bf16, so a UNet steps."""
    family = get_family(ModelConfig(family="sd"))
    unet = family.load_denoiser()
    lora = adapter.add_lora(unet, peft.LoraConfig(r=2, lora_alpha=2, target_modules=family.lora_targets(None)))
    unet.to(torch.bfloat16)  # as DeepSpeed's bf16 mode casts the module
    if checkpointing:
        unet.enable_gradient_checkpointing()
    tc = TrainConfig(precision="bf16", base_weights="fp8", activation_checkpointing=checkpointing)
    precision.prepare_denoiser(unet.train(), tc)
    assert not any(m.weight.dtype == torch.float8_e4m3fn for m in unet.modules() if isinstance(m, torch.nn.Conv2d))
    latents, text = torch.randn(2, 4, 1, 16, 16), {"prompt_embeds": torch.randn(2, 77, 32, dtype=torch.bfloat16)}
    family.loss(unet, latents, text, torch.Generator().manual_seed(0)).mean().backward()
    assert all(p.grad is not None for p in lora) and sum(bool(p.grad.abs().sum() > 0) for p in lora) >= len(lora) // 2


def test_fp8_trains_close_to_bf16_and_resumes_exactly(tiny_run, cli, tmp_path):
    losses = {}
    for kind in ("auto", "fp8"):
        cfg = tiny_run.clone(tmp_path / kind, **TRAIN, base_weights=kind)
        result = cli("train", "-c", str(cfg))
        assert result.returncode == 0, result.stderr[-3000:]
        losses[kind] = [r["loss"] for r in read_metrics(RunPaths(tmp_path / kind / "run").metrics)]
    assert len(losses["fp8"]) == 3
    # float8_e4m3fn keeps 3 mantissa bits (per-weight error up to 6%); measured: losses within 0.2%.
    for a, b in zip(losses["auto"], losses["fp8"], strict=True):
        assert abs(a - b) <= 0.01 * abs(a), (losses["auto"], losses["fp8"])
    assert losses["auto"] != losses["fp8"]  # the fp8 run really ran on float8 weights
    resumed = cli("train", "-c", str(tmp_path / "fp8" / "config.yaml"), "--checkpoint", "step-000001")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = [r["loss"] for r in read_metrics(RunPaths(tmp_path / "fp8" / "run").metrics)]
    assert again == losses["fp8"]
    print("losses bf16", losses["auto"], "fp8", losses["fp8"])
