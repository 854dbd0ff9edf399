"""diffusers format: ``pytorch_lora_weights.safetensors`` written by the pipeline's own saver."""

from __future__ import annotations

import tempfile
from pathlib import Path

import peft
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from diffpipe.models.base import Family
from diffpipe.training.adapter import config_dict
from diffpipe.utils import atomic_path

DIFFUSERS_WEIGHTS = "pytorch_lora_weights.safetensors"


def export_diffusers(
    state_dict: dict[str, torch.Tensor],
    lora_cfg: peft.LoraConfig,
    out_file: str | Path,
    family: Family,
    metadata: dict[str, str] | None = None,
    text_encoders: dict[str, tuple[dict[str, torch.Tensor], peft.LoraConfig]] | None = None,
) -> Path:
    """Write the adapter as the family pipeline's ``save_lora_weights`` does.

    The stock saver adds the component prefix (``unet.`` / ``transformer.``) and
    stores the PEFT config (rank, alpha, targets) as ``lora_adapter_metadata`` in
    the header. ``api`` passes the adapter with its scale folded into ``lora_B`` and
    alpha = rank (``convert.fold_scale``), so ``load_lora_weights`` and readers that
    ignore the header (ComfyUI) both apply the trained strength.
    ``metadata`` (our ``diffpipe.*`` keys) is added to that header. ``text_encoders``: the trained
    encoders' LoRAs (scale folded in too), saved by the same call under their pipeline names, CLIP's layers
    under ``text_model.`` (:func:`clip_paths_as_transformers4`).
    """
    out_file = Path(out_file)
    texts = {name: (clip_paths_as_transformers4(sd), cfg) for name, (sd, cfg) in (text_encoders or {}).items()}
    parts = {family.denoiser_name: (state_dict, lora_cfg), **texts}
    layers = {f"{name}_lora_layers": sd for name, (sd, _) in parts.items()}
    configs = {f"{name}_lora_adapter_metadata": config_dict(cfg) for name, (_, cfg) in parts.items()}
    with atomic_path(out_file) as tmp_file, tempfile.TemporaryDirectory(dir=tmp_file.parent) as tmp:
        (family.lora_writer or family.pipeline_class).save_lora_weights(
            tmp,
            **layers, **configs,
            weight_name=DIFFUSERS_WEIGHTS,
            safe_serialization=True,
        )
        written = Path(tmp) / DIFFUSERS_WEIGHTS
        with safe_open(str(written), framework="pt") as f:
            header = dict(f.metadata() or {})
        save_file(load_file(str(written)), str(tmp_file), metadata={**header, **(metadata or {})})
        tmp_file.chmod(0o644)  # files made inside mkdtemp's private folder are 0600
    return out_file


def clip_paths_as_transformers4(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CLIP's layer paths as transformers 4 named them (``text_model.encoder.layers...``): ComfyUI maps a
    diffusers file's text-encoder LoRA only under those names and drops the rest with a warning, while
    diffusers' loader strips ``text_model.`` where the installed transformers (5) holds CLIP's layers at the top.
    Other encoders' keys (T5's ``encoder.block``, decoder LLMs' ``layers``) are left as they are."""
    return {f"text_model.{k}" if k.startswith("encoder.layers.") else k: v for k, v in state_dict.items()}
