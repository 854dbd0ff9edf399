"""Key map of family ``wan``: diffusers ``WanTransformer3DModel`` <-> the original (Wan) checkpoint.

Names follow ``convert_wan_transformer_to_diffusers`` in diffusers'
``single_file_utils.py``: ``blocks.N.self_attn.{q,k,v,o}``, ``cross_attn``
(plus ``k_img`` / ``v_img`` in image-to-video models), ``ffn.0`` / ``ffn.2``,
and outside the blocks ``patch_embedding`` (a Conv3d), ``text_embedding``,
``time_embedding``, ``time_projection``, ``head.head`` and the i2v image
embedding ``img_emb``. kohya names (musubi-tuner) are ``lora_unet_`` + the
original path.

diffusers' Wan loader (``_convert_non_diffusers_wan_lora_to_diffusers``)
reads alpha inside the blocks only, and rejects an ``.alpha`` on any other
layer: those carry their scale in ``up`` and no ``.alpha`` key (ComfyUI and
musubi-tuner read a missing alpha as alpha = rank, the same thing).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffusers import WanTransformer3DModel

from diffpipe.models.keymap import KeyMap, Layer, kohya_name, plain
from diffpipe.models.spec import Kohya

DENOISER = WanTransformer3DModel
KOHYA = Kohya("wan", "wan2.1/lora", "https://github.com/Wan-Video/Wan2.1")

TOP_LEVEL = {
    "patch_embedding": "patch_embedding",
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "time_projection.1": "condition_embedder.time_proj",
    "img_emb.proj.1": "condition_embedder.image_embedder.ff.net.0.proj",
    "img_emb.proj.3": "condition_embedder.image_embedder.ff.net.2",
    "head.head": "proj_out",
}
# One block: original suffix -> our suffix.
BLOCK = {
    "self_attn.q": "attn1.to_q",
    "self_attn.k": "attn1.to_k",
    "self_attn.v": "attn1.to_v",
    "self_attn.o": "attn1.to_out.0",
    "cross_attn.q": "attn2.to_q",
    "cross_attn.k": "attn2.to_k",
    "cross_attn.v": "attn2.to_v",
    "cross_attn.o": "attn2.to_out.0",
    "cross_attn.k_img": "attn2.add_k_proj",
    "cross_attn.v_img": "attn2.add_v_proj",
    "ffn.0": "ffn.net.0.proj",
    "ffn.2": "ffn.net.2",
}


def build(config: Mapping[str, Any], out_features: Mapping[str, int]) -> KeyMap:
    """The table for a transformer with this config; ``out_features``: its module sizes."""
    layers: list[Layer] = [
        plain(original, ours, out_features[ours], kohya_name(original), fold_scale=True, alpha_key=False)
        for original, ours in TOP_LEVEL.items()
        if ours in out_features
    ]
    for i in range(config["num_layers"]):
        for o, d in BLOCK.items():
            original, ours = f"blocks.{i}.{o}", f"blocks.{i}.{d}"
            if ours in out_features:
                layers.append(plain(original, ours, out_features[ours], kohya_name(original)))
    return KeyMap("wan", layers)
