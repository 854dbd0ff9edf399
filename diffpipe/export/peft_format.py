"""PEFT format: ``adapter_model.safetensors`` (``base_model.model.`` keys) + ``adapter_config.json``.

The layout training already writes, plus our metadata in the header; loads
with ``PeftModel.from_pretrained`` on the bare denoiser or with a diffusers
model's ``load_lora_adapter``.
"""

from __future__ import annotations

import json
from pathlib import Path

import peft
import torch
from safetensors.torch import save_file

from diffpipe.training.adapter import CONFIG_NAME, PEFT_PREFIX, WEIGHTS_NAME, config_dict
from diffpipe.utils import atomic_path


def export_peft(
    state_dict: dict[str, torch.Tensor],
    lora_cfg: peft.LoraConfig,
    out_dir: str | Path,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write a PEFT adapter folder atomically; ``metadata`` goes into the safetensors header."""
    out_dir = Path(out_dir)
    with atomic_path(out_dir, is_dir=True) as tmp:
        tensors = {PEFT_PREFIX + k: v.contiguous() for k, v in state_dict.items()}
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt", **(metadata or {})})
        (tmp / CONFIG_NAME).write_text(json.dumps(config_dict(lora_cfg), indent=2, sort_keys=True))
    return out_dir
