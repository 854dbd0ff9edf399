"""The trained text encoders' LoRAs (``train.text_encoder``) in each export format.

- diffusers: the pipeline's own ``save_lora_weights`` (``text_encoder.`` / ``text_encoder_2.`` keys, the
  scale folded in as for the denoiser), so ``load_lora_weights`` loads them into the encoders;
- PEFT: a PEFT folder per encoder inside the denoiser's (``text_encoder/``), as training writes it;
- kohya and ComfyUI: kohya's names, ``<prefix>_<module path with _>.lora_down/lora_up.weight`` and
  ``.alpha`` (prefix ``lora_te`` for SD 1.x/2.x, ``lora_te1`` / ``lora_te2`` for SDXL: the family's
  ``trainable_text_encoders``), which both sd-scripts and ComfyUI read for CLIP encoders;
- merged: each encoder's weights with its LoRA added.
"""

from __future__ import annotations

import functools
import re

import peft
import torch
from transformers import CLIPTextConfig

from diffpipe.export.convert import Lora, module_loras

#: The CLIP modules kohya's and ComfyUI's text-encoder names cover: the encoder layers' attention
#: and MLP projections (ComfyUI's ``LORA_CLIP_MAP``). Our module paths are relative to the loaded
#: ``CLIPTextModel``, which holds its layers directly (``encoder.layers.0``; older transformers:
#: under ``text_model.``); the file names follow the original checkpoint (``text_model_encoder_...``).
KOHYA_MODULE = re.compile(r"(?:text_model\.)?encoder\.layers\.\d+\.(self_attn\.(q|k|v|out)_proj|mlp\.fc[12])")
_KOHYA_NAME = re.compile(r"text_model_encoder_layers_(\d+)_(self_attn_(?:q|k|v|out)_proj|mlp_fc[12])")

TextLoras = dict[str, tuple[dict[str, torch.Tensor], peft.LoraConfig]]


def kohya_tensors(text: TextLoras, prefixes: dict[str, str], fmt: str) -> dict[str, Lora]:
    """Each encoder's per-module LoRAs under kohya's layer names (``lora_te1_text_model_...``)."""
    out: dict[str, Lora] = {}
    for encoder, (sd, cfg) in text.items():
        for module, lora in module_loras(sd, cfg).items():
            if not KOHYA_MODULE.fullmatch(module):
                raise ValueError(f"export format {fmt}: {encoder}.{module} has no kohya / ComfyUI name (they "
                                 "name the encoder layers' attention and MLP projections: train.text_encoder."
                                 "targets q_proj, k_proj, v_proj, out_proj, fc1, fc2); export diffusers or peft")
            out[f"{prefixes[encoder]}_text_model_{module.removeprefix('text_model.').replace('.', '_')}"] = lora
    return out


def module_of_kohya(name: str, encoder_cls: type) -> str | None:
    """Our module path in an ``encoder_cls`` model of a kohya text-encoder layer name without its prefix
    (``text_model_encoder_layers_0_self_attn_q_proj``); None for a name kohya does not give CLIP layers."""
    m = _KOHYA_NAME.fullmatch(name)
    if m is None:
        return None
    path = f"encoder.layers.{m[1]}." + m[2].replace("self_attn_", "self_attn.").replace("mlp_", "mlp.")
    return clip_module(path, encoder_cls)


def clip_module(path: str, encoder_cls: type) -> str:
    """A CLIP layer's path (with or without ``text_model.``) as it is in an ``encoder_cls`` model."""
    return _clip_root(encoder_cls) + path.removeprefix("text_model.")


@functools.cache
def _clip_root(encoder_cls: type) -> str:
    """``text_model.`` where the installed transformers nests ``encoder_cls``'s layers under it, else ``""``
    (transformers 5: ``CLIPTextModel`` holds them directly, ``CLIPTextModelWithProjection`` under it)."""
    with torch.device("meta"):
        model = encoder_cls(CLIPTextConfig(num_hidden_layers=1, hidden_size=8, intermediate_size=8,
                                           num_attention_heads=1, projection_dim=8))
    return "text_model." if hasattr(model, "text_model") else ""


def merge_into(encoder: torch.nn.Module, sd: dict[str, torch.Tensor], cfg: peft.LoraConfig) -> None:
    """Add each module's LoRA update (``alpha / rank * up @ down``) to ``encoder``'s weights, in place."""
    for module, lora in module_loras(sd, cfg).items():
        weight = encoder.get_submodule(module).weight
        with torch.no_grad():
            weight.copy_((weight.float() + lora.delta().to(weight.device)).to(weight.dtype))
