"""diffusers format: ``pytorch_lora_weights.safetensors`` written by the pipeline's own saver."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from diffpipe.models.base import Family
from diffpipe.training.adapter import config_dict, load_adapter

DIFFUSERS_WEIGHTS = "pytorch_lora_weights.safetensors"


def export_diffusers(adapter_dir: str | Path, out_file: str | Path, family: Family) -> Path:
    """Write the adapter as the family pipeline's ``save_lora_weights`` does.

    The stock saver adds the component prefix (``unet.`` / ``transformer.``) and
    stores the PEFT config (rank, alpha, targets) as ``lora_adapter_metadata`` in
    the header, so ``load_lora_weights`` restores the trained scale exactly.
    """
    state_dict, lora_cfg = load_adapter(adapter_dir)
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    name = family.denoiser_name
    with tempfile.TemporaryDirectory(dir=out_file.parent, prefix=".tmp-export-") as tmp:
        family.pipeline_class.save_lora_weights(
            tmp,
            **{f"{name}_lora_layers": state_dict, f"{name}_lora_adapter_metadata": config_dict(lora_cfg)},
            weight_name=DIFFUSERS_WEIGHTS,
            safe_serialization=True,
        )
        os.replace(Path(tmp) / DIFFUSERS_WEIGHTS, out_file)
    return out_file
