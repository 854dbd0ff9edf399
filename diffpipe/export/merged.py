"""Merged format: the base pipeline with the LoRA fused into the denoiser, as a diffusers folder."""

from __future__ import annotations

import json
from pathlib import Path

from peft.tuners.tuners_utils import BaseTunerLayer

from diffpipe.export.text_encoders import merge_into
from diffpipe.models.base import Family, split_parts
from diffpipe.training.adapter import apply_state, load_adapter
from diffpipe.training.text_encoders import load_text_adapters
from diffpipe.utils import atomic_path

INFO_NAME = "diffpipe_lora.json"


def export_merged(adapter_dir: str | Path, out_dir: str | Path, family: Family,
                  metadata: dict[str, str] | None = None) -> Path:
    """Load the family pipeline, merge the adapter at its trained scale, ``save_pretrained`` atomically.

    Each trained part (both Wan 2.2 A14B experts with ``model.expert: both``) gets its
    own LoRA fused in, and each text encoder trained beside it (``train.text_encoder``) its own. The folder loads with ``<Pipeline>.from_pretrained`` and needs
    no LoRA support; ``diffpipe_lora.json`` records which LoRA was fused in.
    """
    pipe = family.load_pipeline()
    state_dict, lora_cfg = load_adapter(adapter_dir)
    for attr, part_state in split_parts(state_dict, family.denoiser_parts).items():
        denoiser = family.trained_base(getattr(pipe, attr))
        setattr(pipe, attr, denoiser)
        apply_state(denoiser, part_state, lora_cfg, source=f"{adapter_dir} ({attr})")
        for module in denoiser.modules():  # PEFT's own merge: LoRA, DoRA, LoKr and LoHa alike
            if isinstance(module, BaseTunerLayer):
                module.merge()
        denoiser.unload_lora()  # drop the adapter layers, keep the merged weights
    for name, (sd, cfg) in load_text_adapters(adapter_dir).items():  # train.text_encoder
        merge_into(getattr(pipe, name), sd, cfg)
    out_dir = Path(out_dir)
    with atomic_path(out_dir, is_dir=True) as tmp:
        pipe.save_pretrained(tmp, safe_serialization=True)
        (tmp / INFO_NAME).write_text(json.dumps(metadata or {}, indent=2, sort_keys=True))
    return out_dir
