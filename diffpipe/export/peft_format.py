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
    text_encoders: dict[str, tuple[dict[str, torch.Tensor], peft.LoraConfig]] | None = None,
) -> Path:
    """Write a PEFT adapter folder atomically; ``metadata`` goes into the safetensors header.

    ``text_encoders``: each trained encoder's LoRA as a PEFT folder of its own inside, named after it
    (``text_encoder/``: loads with ``PeftModel.from_pretrained`` on that encoder)."""
    out_dir = Path(out_dir)
    with atomic_path(out_dir, is_dir=True) as tmp:
        for folder, (sd, cfg) in {tmp: (state_dict, lora_cfg),
                                  **{tmp / name: part for name, part in (text_encoders or {}).items()}}.items():
            folder.mkdir(exist_ok=True)
            tensors = {PEFT_PREFIX + k: v.contiguous() for k, v in sd.items()}
            save_file(tensors, str(folder / WEIGHTS_NAME), metadata={"format": "pt", **(metadata or {})})
            (folder / CONFIG_NAME).write_text(json.dumps(config_dict(cfg), indent=2, sort_keys=True))
    return out_dir
