"""Key map of family ``flux2-klein``: diffusers ``Flux2Transformer2DModel`` <-> the original (BFL) checkpoint.

Names follow ``convert_flux2_transformer_checkpoint_to_diffusers`` in diffusers' ``single_file_utils.py``
(the names ComfyUI's model keeps). The original fuses each double block's attention q, k, v into one
``qkv`` per stream; a single block's ``linear1`` / ``linear2`` are diffusers' fused ``to_qkv_mlp_proj`` /
``to_out`` whole. The modulations are three shared layers outside the blocks. The final modulation
stores (shift, scale) where diffusers stores (scale, shift): one module in two segments, halves swapped.
kohya names are ``lora_unet_`` + the original path (diffusers' ``_convert_kohya_flux2_lora_to_diffusers``).

Every layer carries its scale in ``up`` and no ``.alpha``, with ``lora_A``/``lora_B`` names in the
ComfyUI file: diffusers' reader of that file (``_convert_non_diffusers_flux2_lora_to_diffusers``) takes
``lora_A``/``lora_B`` only and ignores alpha, and ComfyUI reads a missing alpha as scale 1. That reader
maps ``final_layer.adaLN_modulation.1`` onto ``norm_out.linear`` without swapping the halves its own
single-file converter swaps; the file follows the checkpoint (and ComfyUI), so a LoRA on ``norm_out``
loads exactly in ComfyUI and through ``diffpipe import-lora``, not through that reader.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffusers import Flux2Transformer2DModel

from diffpipe.families.flux.keymap import double_blocks  # the double blocks' fused qkv, as in FLUX.1
from diffpipe.models.keymap import KeyMap, Layer, Segment, layer, swapped_halves
from diffpipe.models.spec import Kohya

DENOISER = Flux2Transformer2DModel
KOHYA = Kohya("flux2", "flux-2-klein/lora", "https://github.com/black-forest-labs/flux2")

DOUBLE_PLAIN = {
    "img_attn.proj": "attn.to_out.0",
    "txt_attn.proj": "attn.to_add_out",
    "img_mlp.0": "ff.linear_in",
    "img_mlp.2": "ff.linear_out",
    "txt_mlp.0": "ff_context.linear_in",
    "txt_mlp.2": "ff_context.linear_out",
}
SINGLE_PLAIN = {"linear1": "attn.to_qkv_mlp_proj", "linear2": "attn.to_out"}
TOP_LEVEL = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in.in_layer": "time_guidance_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_guidance_embed.timestep_embedder.linear_2",
    "guidance_in.in_layer": "time_guidance_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_guidance_embed.guidance_embedder.linear_2",
    "double_stream_modulation_img.lin": "double_stream_modulation_img.linear",
    "double_stream_modulation_txt.lin": "double_stream_modulation_txt.linear",
    "single_stream_modulation.lin": "single_stream_modulation.linear",
    "final_layer.linear": "proj_out",
}


def _layer(original: str, segments: list[Segment]) -> Layer:
    return layer(original, segments, fold_scale=True, alpha_key=False)


def build(config: Mapping[str, Any], out_features: Mapping[str, int], family: str = "flux2-klein") -> KeyMap:
    """The table for a transformer with this config; ``out_features``: its module sizes (``family``: the
    family it is built for, ``flux2`` shares it)."""
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    layers: list[Layer] = []

    def add_plain(original: str, ours: str) -> None:
        if ours in out_features:  # the guidance embedder exists only with guidance_embeds
            layers.append(_layer(original, [Segment(ours, 0, out_features[ours])]))

    for original, ours in TOP_LEVEL.items():
        add_plain(original, ours)
    final = swapped_halves("norm_out.linear", out_features["norm_out.linear"])
    layers.append(_layer("final_layer.adaLN_modulation.1", final))
    layers += double_blocks(config["num_layers"], inner, DOUBLE_PLAIN, out_features, _layer)
    for i in range(config["num_single_layers"]):
        for o, d in SINGLE_PLAIN.items():
            add_plain(f"single_blocks.{i}.{o}", f"single_transformer_blocks.{i}.{d}")
    return KeyMap(family, layers, peft_names=True)
