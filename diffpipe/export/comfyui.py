"""ComfyUI format: original checkpoint names under ``diffusion_model.``, kohya tensor names.

Keys per original layer ``x``: ``diffusion_model.x.lora_down.weight``,
``.lora_up.weight`` (``lora_A`` / ``lora_B`` where ``KeyMap.peft_names``) and ``.alpha`` (ComfyUI scales by alpha / rank and uses
1.0 when alpha is missing, so alpha is written unless the layer holds scale 1
and a reference loader rejects the key: ``Layer.alpha_key``). ComfyUI maps
``diffusion_model.<original path>`` for every model it supports (HunyuanVideo's
embedders: ComfyUI's own names, ``Layer.comfy``); fused layers
(Flux ``qkv``, ``linear1``) are built exactly by ``convert.to_original``.
"""

from __future__ import annotations

from pathlib import Path

from diffpipe.export.convert import Lora, to_original
from diffpipe.export.keymaps import KeyMap
from diffpipe.export.lycoris import Product, refuse_restructured, write_products
from diffpipe.export.original_io import write_original

PREFIX = "diffusion_model."


def export_comfyui(mods: dict[str, Lora] | dict[str, Product], keymap: KeyMap, out_file: str | Path,
                   metadata: dict[str, str] | None = None, text: dict[str, Lora] | None = None) -> Path:
    """Write our per-module LoRAs as a ComfyUI LoRA file; ``text``: the trained text encoders' LoRAs under
    kohya's names, which ComfyUI's CLIP loader reads (``export.text_encoders.kohya_tensors``)."""
    if mods and isinstance(next(iter(mods.values())), Product):  # LoKr / LoHa: LyCORIS tensors
        layers = refuse_restructured(mods, keymap, "comfyui", next(iter(mods.values())).kind)
        return write_products(mods, {m: PREFIX + layer.comfy_name for m, layer in layers.items()}, out_file, metadata)
    loras, layout = to_original(mods, keymap)
    named = {PREFIX + layer.comfy_name: lora for layer, lora in loras.items()} | (text or {})
    bare = frozenset(PREFIX + layer.comfy_name for layer in loras if not layer.alpha_key)
    return write_original(named, layout, out_file, metadata, without_alpha=bare, peft_names=keymap.peft_names)
