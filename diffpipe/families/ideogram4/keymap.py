"""Key map of family ``ideogram4``: diffusers ``Ideogram4Transformer2DModel`` <-> the original checkpoint.

The original checkpoint (as Ideogram released it, and as ai-toolkit names its LoRAs under
``diffusion_model.``) uses diffusers' module names except in attention: one fused ``attention.qkv``
(q, k, v rows in that order) and ``attention.o`` for diffusers' ``to_q/to_k/to_v`` and ``to_out.0``
(diffusers' ``_convert_non_diffusers_ideogram4_lora_to_diffusers`` splits them so; the published
diffusers folders were converted from the fused layout by slicing rows). kohya names are ``lora_unet_`` +
the original path. That converter reads the blocks' layers only (attention, feed-forward, AdaLN
modulation) and rejects a file with any other layer: a LoRA on the embedders or the final layer is
written under their (unchanged) names for ``diffpipe import-lora`` and tools that map names generically.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffusers import Ideogram4Transformer2DModel

from diffpipe.models.keymap import KeyMap, Layer, Segment, kohya_name, layer, plain
from diffpipe.models.spec import Kohya

DENOISER = Ideogram4Transformer2DModel
#: No kohya-family trainer names it: the metadata says what the file is in the same scheme.
KOHYA = Kohya("ideogram4", "ideogram-4/lora", "https://github.com/huggingface/diffusers")

#: The original attention's names: fused q, k, v, and the output projection.
QKV = ("attention.to_q", "attention.to_k", "attention.to_v")
OUT = {"attention.o": "attention.to_out.0"}


def build(config: Mapping[str, Any], out_features: Mapping[str, int]) -> KeyMap:
    """The table for a transformer with this config; ``out_features``: its module sizes."""
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    layers: list[Layer] = []
    fused = set()
    for i in range(config["num_layers"]):
        block = f"layers.{i}"
        layers.append(layer(f"{block}.attention.qkv", [Segment(f"{block}.{m}", 0, inner) for m in QKV]))
        for original, ours in OUT.items():
            layers.append(plain(f"{block}.{original}", f"{block}.{ours}", inner, kohya_name(f"{block}.{original}")))
        fused |= {f"{block}.{m}" for m in (*QKV, *OUT.values())}
    layers += [plain(m, m, n, kohya_name(m)) for m, n in out_features.items() if m not in fused]
    return KeyMap("ideogram4", layers)
