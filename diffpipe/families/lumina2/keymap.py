"""Key map of family ``lumina2``: diffusers ``Lumina2Transformer2DModel`` <-> the original checkpoint.

Names follow ``convert_lumina2_to_diffusers`` in diffusers'
``single_file_utils.py`` (Lumina-Image-2.0's NextDiT, also ComfyUI's): each of
the ``noise_refiner``, ``context_refiner`` and ``layers`` blocks fuses q, k, v
into ``attention.qkv`` (q has all heads, k and v the fewer key/value heads:
split sizes from the modules), ``attention.out``, ``feed_forward.w1/w2/w3``
and, outside the context refiner, ``adaLN_modulation.1``; around them
``x_embedder``, ``t_embedder.mlp``, ``cap_embedder.1`` and ``final_layer``.
kohya names (sd-scripts' Lumina LoRA) are ``lora_unet_`` + the original path.

diffusers' Lumina 2 loader (``_convert_non_diffusers_lumina2_lora_to_diffusers``)
reads ``diffusion_model.*`` with PEFT tensor names only (the ComfyUI file uses
``lora_A`` / ``lora_B``, which ComfyUI reads too), gives q, k and v the fused
``down`` and their rows of ``up`` (exact for our block-structured fused layers),
ignores alpha and rejects ``.alpha`` keys: every layer carries its scale in
``up`` and no ``.alpha`` (alpha = rank everywhere). That loader also expects
every block layer (q/k/v, out, w1-w3, adaLN) and Lumina-Image-2.0's sizes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffusers import Lumina2Transformer2DModel

from diffpipe.models.keymap import KeyMap, Layer, Segment, kohya_name, whole_layers
from diffpipe.models.spec import Kohya

DENOISER = Lumina2Transformer2DModel
KOHYA = Kohya("lumina2", "lumina-2/lora", "https://github.com/Alpha-VLLM/Lumina-Image-2.0")

TOP_LEVEL = {
    "x_embedder": "x_embedder",
    "t_embedder.mlp.0": "time_caption_embed.timestep_embedder.linear_1",
    "t_embedder.mlp.2": "time_caption_embed.timestep_embedder.linear_2",
    "cap_embedder.1": "time_caption_embed.caption_embedder.1",
    "final_layer.adaLN_modulation.1": "norm_out.linear_1",
    "final_layer.linear": "norm_out.linear_2",
}
BLOCK = {
    "attention.out": "attn.to_out.0",
    "feed_forward.w1": "feed_forward.linear_1",
    "feed_forward.w2": "feed_forward.linear_2",
    "feed_forward.w3": "feed_forward.linear_3",
    "adaLN_modulation.1": "norm1.linear",
}
QKV = ("attn.to_q", "attn.to_k", "attn.to_v")


def _layer(original: str, segments: list[Segment]) -> Layer:
    return Layer(original, kohya_name(original), tuple(segments), fold_scale=True, alpha_key=False)


def build(config: Mapping[str, Any], out_features: Mapping[str, int]) -> KeyMap:
    """The table for a transformer with this config; ``out_features``: its module sizes."""
    layers = whole_layers(TOP_LEVEL, out_features, _layer)
    stacks = {
        "noise_refiner": config["num_refiner_layers"],
        "context_refiner": config["num_refiner_layers"],
        "layers": config["num_layers"],
    }
    for stack, n in stacks.items():
        for i in range(n):
            block = f"{stack}.{i}"
            layers.append(
                _layer(
                    f"{block}.attention.qkv", [Segment(f"{block}.{p}", 0, out_features[f"{block}.{p}"]) for p in QKV]
                )
            )
            for o, d in BLOCK.items():
                if f"{block}.{d}" in out_features:
                    layers.append(_layer(f"{block}.{o}", [Segment(f"{block}.{d}", 0, out_features[f"{block}.{d}"])]))
    return KeyMap("lumina2", layers, peft_names=True)
