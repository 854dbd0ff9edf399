"""Key map of family ``chroma``: diffusers ``ChromaTransformer2DModel`` <-> the original checkpoint.

Chroma keeps Flux's block layout and names (``double_blocks`` with fused
``qkv``, ``single_blocks`` with fused ``linear1``: ``flux.transformer_layers``)
but has no per-block modulation linears and no final modulation: one
``distilled_guidance_layer`` computes every modulation. Names follow
``convert_chroma_transformer_checkpoint_to_diffusers`` in diffusers'
``single_file_utils.py``; kohya names (sd-scripts' Chroma LoRA) are
``lora_unet_`` + the original path, and ``final_layer`` carries its scale in
``up`` because ``ChromaPipeline`` reads kohya files with the Flux converter,
which ignores alpha there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffusers import ChromaTransformer2DModel

from diffpipe.families.flux.keymap import transformer_layers
from diffpipe.models.keymap import KeyMap
from diffpipe.models.spec import Kohya

DENOISER = ChromaTransformer2DModel
KOHYA = Kohya("chroma", "chroma/lora", "https://huggingface.co/lodestones/Chroma")

TOP_LEVEL = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "distilled_guidance_layer.in_proj": "distilled_guidance_layer.in_proj",
    "distilled_guidance_layer.out_proj": "distilled_guidance_layer.out_proj",
    "final_layer.linear": "proj_out",
}


def build(config: Mapping[str, Any], out_features: Mapping[str, int]) -> KeyMap:
    top = dict(TOP_LEVEL)
    for i in range(config["approximator_layers"]):
        ours, original = f"distilled_guidance_layer.layers.{i}", f"distilled_guidance_layer.layers.{i}"
        top[f"{original}.in_layer"] = f"{ours}.linear_1"
        top[f"{original}.out_layer"] = f"{ours}.linear_2"
    return KeyMap("chroma", transformer_layers(config, out_features, top))
