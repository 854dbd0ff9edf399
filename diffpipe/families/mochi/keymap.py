"""Key map of family ``mochi``: diffusers ``MochiTransformer3DModel`` <-> the original (Genmo Mochi 1) checkpoint.

Names follow ``convert_mochi_transformer_checkpoint_to_diffusers`` in
diffusers' ``single_file_utils.py``; ComfyUI's Mochi model uses them too. Each
block ``blocks.N`` has ``mod_x`` / ``mod_y`` (modulations), ``attn.qkv_x`` /
``attn.qkv_y`` (q, k, v fused per stream), ``attn.proj_x`` / ``attn.proj_y``
and ``mlp_x`` / ``mlp_y`` with ``w1`` and ``w2``; the last block's text stream
only modulates. ``w1`` holds the SwiGLU halves in the other order than
diffusers' ``ff.net.0.proj``, and ``final_layer.mod`` (shift, scale) where
diffusers' ``norm_out.linear`` holds (scale, shift): one module in two
segments, halves swapped. Outside the blocks: ``x_embedder.proj`` (a Conv2d),
``t_embedder.mlp``, the caption pooler ``t5_y_embedder`` and ``t5_yproj``,
``final_layer.linear``. kohya names are ``lora_unet_`` + the original path
(what ComfyUI maps for every model; no kohya trainer covers Mochi).

diffusers' Mochi pipeline reads only its own (diffusers-named) LoRAs; ComfyUI
and ``diffpipe import-lora`` read these, alpha included.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffusers import MochiTransformer3DModel

from diffpipe.models.keymap import KeyMap, Segment, layer, swapped_halves, whole_layers
from diffpipe.models.spec import Kohya

DENOISER = MochiTransformer3DModel
KOHYA = Kohya("mochi", "mochi-1/lora", "https://github.com/genmoai/mochi")

TOP_LEVEL = {
    "x_embedder.proj": "patch_embed.proj",
    "t_embedder.mlp.0": "time_embed.timestep_embedder.linear_1",
    "t_embedder.mlp.2": "time_embed.timestep_embedder.linear_2",
    "t5_y_embedder.to_kv": "time_embed.pooler.to_kv",
    "t5_y_embedder.to_q": "time_embed.pooler.to_q",
    "t5_y_embedder.to_out": "time_embed.pooler.to_out",
    "t5_yproj": "time_embed.caption_proj",
    "final_layer.linear": "proj_out",
}
# One block: original suffix -> our suffix. ``mod_y`` is ``norm1_context.linear_1`` in the last block.
BLOCK = {
    "mod_x": "norm1.linear",
    "mod_y": "norm1_context.linear",
    "attn.proj_x": "attn1.to_out.0",
    "attn.proj_y": "attn1.to_add_out",
    "mlp_x.w2": "ff.net.2",
    "mlp_y.w2": "ff_context.net.2",
}
LAST_BLOCK = {"mod_y": "norm1_context.linear_1"}
FUSED = {
    "attn.qkv_x": ("attn1.to_q", "attn1.to_k", "attn1.to_v"),
    "attn.qkv_y": ("attn1.add_q_proj", "attn1.add_k_proj", "attn1.add_v_proj"),
}
SWAPPED = {"mlp_x.w1": "ff.net.0.proj", "mlp_y.w1": "ff_context.net.0.proj"}


def build(config: Mapping[str, Any], out_features: Mapping[str, int]) -> KeyMap:
    """The table for a transformer with this config; ``out_features``: its module sizes."""
    layers = whole_layers(TOP_LEVEL, out_features)
    layers.append(layer("final_layer.mod", swapped_halves("norm_out.linear", out_features["norm_out.linear"])))
    n = config["num_layers"]
    for i in range(n):
        original, ours = f"blocks.{i}", f"transformer_blocks.{i}"
        plain = BLOCK | LAST_BLOCK if i == n - 1 else BLOCK
        for o, d in plain.items():
            if f"{ours}.{d}" in out_features:
                layers.append(layer(f"{original}.{o}", [Segment(f"{ours}.{d}", 0, out_features[f"{ours}.{d}"])]))
        for o, parts in FUSED.items():
            layers.append(
                layer(f"{original}.{o}", [Segment(f"{ours}.{p}", 0, out_features[f"{ours}.{p}"]) for p in parts])
            )
        for o, d in SWAPPED.items():
            if f"{ours}.{d}" in out_features:
                layers.append(layer(f"{original}.{o}", swapped_halves(f"{ours}.{d}", out_features[f"{ours}.{d}"])))
    return KeyMap("mochi", layers)
