"""A tiny-SD adapter folder as training writes it, with random ``up`` matrices and alpha != rank (a lost
alpha shows): the export tests' stand-in for a trained LoRA (``from tiny_adapters import sd_adapter``)."""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe.config import LoraConfig, ModelConfig
from diffpipe.families import get_family
from diffpipe.training.adapter import add_lora, lora_state_dict, peft_config, save_adapter

TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]


def _randomised(model: torch.nn.Module, cfg, seed: int) -> dict[str, torch.Tensor]:
    add_lora(model, cfg)
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.1
    return lora_state_dict(model)


def sd_adapter(folder: Path, *, text_encoder: bool = True):
    """``(family, folder)``: the tiny UNet's LoRA (and the text encoder's), alpha 6 at rank 4, saved in ``folder``."""
    family = get_family(ModelConfig(family="sd", flavor="tiny"))
    targets = family.lora_targets(None) + ["conv_shortcut"]
    cfg = peft_config(LoraConfig(rank=4, alpha=6.0, targets=targets), targets)
    unet = _randomised(family.load_denoiser(), cfg, 1)
    text = {}
    if text_encoder:
        text_cfg = peft_config(LoraConfig(rank=4, alpha=6.0, targets=TEXT_TARGETS), TEXT_TARGETS)
        encoder = family.load_text_encoders(only=["text_encoder"]).text_encoder
        text = {"text_encoder": (_randomised(encoder, text_cfg, 2), text_cfg)}
    save_adapter(folder, unet, cfg, {"family": "sd", "flavor": "tiny", "step": 3, "epoch": 1}, text)
    return family, folder
