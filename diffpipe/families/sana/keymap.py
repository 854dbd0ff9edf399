"""Key map of family ``sana``: diffusers ``SanaTransformer2DModel`` <-> the original checkpoint.

Names follow ``convert_sana_transformer_to_diffusers`` in diffusers' ``single_file_utils.py``. The
original fuses self-attention q, k, v into ``blocks.N.attn.qkv`` and cross-attention k, v into
``blocks.N.cross_attn.kv_linear`` (one module per part, in that row order); the rest are renamed:
``attn.proj``, ``cross_attn.q_linear`` / ``proj``, the Mix-FFN convolutions
``mlp.inverted_conv.conv`` / ``depth_conv.conv`` / ``point_conv.conv``, ``x_embedder.proj``,
``t_embedder.mlp.0/2``, ``t_block.1``, ``y_embedder.y_proj.fc1/fc2`` and ``final_layer.linear``. kohya
names are ``lora_unet_`` + the original path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffusers import SanaTransformer2DModel

from diffpipe.models.keymap import KeyMap, Layer, Segment, layer
from diffpipe.models.spec import Kohya

DENOISER = SanaTransformer2DModel
#: No kohya-family trainer names it: the metadata says what the file is in the same scheme.
KOHYA = Kohya("sana", "sana/lora", "https://github.com/NVlabs/Sana")

TOP_LEVEL = {
    "x_embedder.proj": "patch_embed.proj",
    "t_embedder.mlp.0": "time_embed.emb.timestep_embedder.linear_1",
    "t_embedder.mlp.2": "time_embed.emb.timestep_embedder.linear_2",
    "t_block.1": "time_embed.linear",
    "y_embedder.y_proj.fc1": "caption_projection.linear_1",
    "y_embedder.y_proj.fc2": "caption_projection.linear_2",
    "final_layer.linear": "proj_out",
}
BLOCK = {
    "attn.proj": "attn1.to_out.0",
    "cross_attn.q_linear": "attn2.to_q",
    "cross_attn.proj": "attn2.to_out.0",
    "mlp.inverted_conv.conv": "ff.conv_inverted",
    "mlp.depth_conv.conv": "ff.conv_depth",
    "mlp.point_conv.conv": "ff.conv_point",
}
FUSED = {"attn.qkv": ("attn1.to_q", "attn1.to_k", "attn1.to_v"), "cross_attn.kv_linear": ("attn2.to_k", "attn2.to_v")}


def build(config: Mapping[str, Any], out_features: Mapping[str, int]) -> KeyMap:
    """The table for a transformer with this config; ``out_features``: its module sizes."""
    layers: list[Layer] = []

    def segments(*ours: str) -> list[Segment]:
        return [Segment(m, 0, out_features[m]) for m in ours]

    for original, ours in TOP_LEVEL.items():
        layers.append(layer(original, segments(ours)))
    for i in range(config["num_layers"]):
        block = f"transformer_blocks.{i}"
        for o, d in BLOCK.items():
            layers.append(layer(f"blocks.{i}.{o}", segments(f"{block}.{d}")))
        for o, parts in FUSED.items():
            layers.append(layer(f"blocks.{i}.{o}", segments(*(f"{block}.{p}" for p in parts))))
    return KeyMap("sana", layers)
