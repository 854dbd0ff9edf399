"""Key map of family ``sd3``: diffusers ``SD3Transformer2DModel`` <-> the original (MMDiT) checkpoint.

Names follow ``convert_sd3_transformer_checkpoint_to_diffusers`` in diffusers'
``single_file_utils.py``: ``joint_blocks.N.x_block`` (image stream) and
``context_block`` (text stream), each with q, k, v fused into ``attn.qkv``,
``attn.proj``, ``adaLN_modulation.1`` and ``mlp.fc1/fc2``; SD 3.5 Medium's
dual-attention blocks add ``x_block.attn2``. The last block's context stream
only modulates (no projection or MLP), and stores its modulation as (shift,
scale) where diffusers stores (scale, shift), like ``final_layer``: one module
in two segments, halves swapped. kohya names (sd-scripts' SD3 LoRA) are
``lora_unet_`` + the original path. diffusers has no loader for SD3 LoRAs in
these names; ComfyUI and ``diffpipe import-lora`` read them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffusers import SD3Transformer2DModel

from diffpipe.models.keymap import KeyMap, Segment, layer, swapped_halves, whole_layers
from diffpipe.models.spec import Kohya

DENOISER = SD3Transformer2DModel
KOHYA = Kohya("sd3", "stable-diffusion-3/lora", "https://github.com/Stability-AI/sd3.5")

TOP_LEVEL = {
    "x_embedder.proj": "pos_embed.proj",
    "context_embedder": "context_embedder",
    "t_embedder.mlp.0": "time_text_embed.timestep_embedder.linear_1",
    "t_embedder.mlp.2": "time_text_embed.timestep_embedder.linear_2",
    "y_embedder.mlp.0": "time_text_embed.text_embedder.linear_1",
    "y_embedder.mlp.2": "time_text_embed.text_embedder.linear_2",
    "final_layer.linear": "proj_out",
}
# Per stream: original suffix -> our suffix (plain layers), and the fused q, k, v.
X_BLOCK = {
    "attn.proj": "attn.to_out.0",
    "adaLN_modulation.1": "norm1.linear",
    "mlp.fc1": "ff.net.0.proj",
    "mlp.fc2": "ff.net.2",
    "attn2.proj": "attn2.to_out.0",
}
CONTEXT_BLOCK = {"attn.proj": "attn.to_add_out", "mlp.fc1": "ff_context.net.0.proj", "mlp.fc2": "ff_context.net.2"}
FUSED = {
    "x_block.attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "x_block.attn2.qkv": ("attn2.to_q", "attn2.to_k", "attn2.to_v"),
    "context_block.attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}


def build(config: Mapping[str, Any], out_features: Mapping[str, int]) -> KeyMap:
    """The table for a transformer with this config; ``out_features``: its module sizes."""
    layers = whole_layers(TOP_LEVEL, out_features)
    modulation = swapped_halves("norm_out.linear", out_features["norm_out.linear"])
    layers.append(layer("final_layer.adaLN_modulation.1", modulation))
    n = config["num_layers"]
    for i in range(n):
        ours, original = f"transformer_blocks.{i}", f"joint_blocks.{i}"
        plain = {f"x_block.{o}": d for o, d in X_BLOCK.items()} | {
            f"context_block.{o}": d for o, d in CONTEXT_BLOCK.items()
        }
        for o, d in plain.items():
            if f"{ours}.{d}" in out_features:
                layers.append(layer(f"{original}.{o}", [Segment(f"{ours}.{d}", 0, out_features[f"{ours}.{d}"])]))
        for o, parts in FUSED.items():
            if f"{ours}.{parts[0]}" in out_features:
                layers.append(
                    layer(f"{original}.{o}", [Segment(f"{ours}.{p}", 0, out_features[f"{ours}.{p}"]) for p in parts])
                )
        context_mod, size = f"{ours}.norm1_context.linear", out_features[f"{ours}.norm1_context.linear"]
        if i == n - 1:  # context_pre_only: AdaLayerNormContinuous, (scale, shift) in diffusers
            layers.append(layer(f"{original}.context_block.adaLN_modulation.1", swapped_halves(context_mod, size)))
        else:
            layers.append(layer(f"{original}.context_block.adaLN_modulation.1", [Segment(context_mod, 0, size)]))
    return KeyMap("sd3", layers)
