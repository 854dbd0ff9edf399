"""Key map of family ``hunyuanvideo``: diffusers ``HunyuanVideoTransformer3DModel`` <-> the original checkpoint.

Names follow ``convert_hunyuan_video_transformer_to_diffusers`` in diffusers'
``single_file_utils.py`` (HunyuanVideo's own module names): the double blocks
fuse q, k, v per stream into ``img_attn_qkv`` / ``txt_attn_qkv``, the single
blocks fuse q, k, v and the MLP input into ``linear1`` (split sizes from the
modules), the text input's token refiner fuses ``self_attn_qkv``; the final
modulation stores (shift, scale) where diffusers stores (scale, shift): one
module in two segments, halves swapped. kohya names (musubi-tuner's
HunyuanVideo LoRA) are ``lora_unet_`` + the original path.

diffusers' HunyuanVideo loader (``_convert_hunyuan_video_lora_to_diffusers``)
reads these names under ``diffusion_model.`` with PEFT tensor names only (it
gives q, k, v the fused ``down`` and their rows of ``up``: exact for our
block-structured fused layers) and no alpha: the ComfyUI file names its
tensors ``lora_A`` / ``lora_B`` (ComfyUI reads them too) and every layer
carries its scale in ``up`` with no ``.alpha`` key. That loader hard-codes
HunyuanVideo's inner size (3072) for ``linear1``, and cannot read a LoRA on
the final modulation or the token refiner's ``self_attn_qkv`` (it splits
``down`` like ``up``).

ComfyUI renames four embedders on load (``time_in``, ``guidance_in``,
``txt_in.t_embedder``: ``mlp.0`` / ``mlp.2`` -> ``in_layer`` / ``out_layer``;
``txt_in.c_embedder``: ``linear_1`` / ``linear_2`` -> the same) and maps LoRA
names back for the blocks only: a LoRA on those embedders (not a default
target) loads in diffusers and ``diffpipe import-lora``, not in ComfyUI.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffusers import HunyuanVideoTransformer3DModel

from diffpipe.export.keymaps.base import KeyMap, Layer, Segment, kohya_name

DENOISER = HunyuanVideoTransformer3DModel

TOP_LEVEL = {
    "img_in.proj": "x_embedder.proj",
    "time_in.mlp.0": "time_text_embed.timestep_embedder.linear_1",
    "time_in.mlp.2": "time_text_embed.timestep_embedder.linear_2",
    "guidance_in.mlp.0": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.mlp.2": "time_text_embed.guidance_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "txt_in.input_embedder": "context_embedder.proj_in",
    "txt_in.t_embedder.mlp.0": "context_embedder.time_text_embed.timestep_embedder.linear_1",
    "txt_in.t_embedder.mlp.2": "context_embedder.time_text_embed.timestep_embedder.linear_2",
    "txt_in.c_embedder.linear_1": "context_embedder.time_text_embed.text_embedder.linear_1",
    "txt_in.c_embedder.linear_2": "context_embedder.time_text_embed.text_embedder.linear_2",
    "final_layer.linear": "proj_out",
}
# Per block kind: original prefix, ours, plain layers (original suffix -> ours), fused layers.
REFINER_PLAIN = {
    "self_attn_proj": "attn.to_out.0",
    "mlp.fc1": "ff.net.0.proj",
    "mlp.fc2": "ff.net.2",
    "adaLN_modulation.1": "norm_out.linear",
}
REFINER_FUSED = {"self_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v")}
DOUBLE_PLAIN = {
    "img_mod.linear": "norm1.linear",
    "txt_mod.linear": "norm1_context.linear",
    "img_attn_proj": "attn.to_out.0",
    "txt_attn_proj": "attn.to_add_out",
    "img_mlp.fc1": "ff.net.0.proj",
    "img_mlp.fc2": "ff.net.2",
    "txt_mlp.fc1": "ff_context.net.0.proj",
    "txt_mlp.fc2": "ff_context.net.2",
}
DOUBLE_FUSED = {
    "img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}
SINGLE_PLAIN = {"linear2": "proj_out", "modulation.linear": "norm.linear"}
SINGLE_FUSED = {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}


def _layer(original: str, segments: list[Segment]) -> Layer:
    return Layer(original, kohya_name(original), tuple(segments), fold_scale=True, alpha_key=False)


def build(config: Mapping[str, Any], out_features: Mapping[str, int]) -> KeyMap:
    """The table for a transformer with this config; ``out_features``: its module sizes."""
    layers = [_layer(o, [Segment(d, 0, out_features[d])]) for o, d in TOP_LEVEL.items() if d in out_features]
    half = out_features["norm_out.linear"] // 2  # norm_out.linear = (scale, shift); the original (shift, scale)
    layers.append(
        _layer(
            "final_layer.adaLN_modulation.1",
            [Segment("norm_out.linear", half, half), Segment("norm_out.linear", 0, half)],
        )
    )
    stacks = [
        ("txt_in.individual_token_refiner.blocks", "context_embedder.token_refiner.refiner_blocks",
         config["num_refiner_layers"], REFINER_PLAIN, REFINER_FUSED),
        ("double_blocks", "transformer_blocks", config["num_layers"], DOUBLE_PLAIN, DOUBLE_FUSED),
        ("single_blocks", "single_transformer_blocks", config["num_single_layers"], SINGLE_PLAIN, SINGLE_FUSED),
    ]  # fmt: skip
    for original_stack, our_stack, n, plain, fused in stacks:
        for i in range(n):
            original, ours = f"{original_stack}.{i}", f"{our_stack}.{i}"
            for o, d in plain.items():
                if f"{ours}.{d}" in out_features:
                    layers.append(_layer(f"{original}.{o}", [Segment(f"{ours}.{d}", 0, out_features[f"{ours}.{d}"])]))
            for o, parts in fused.items():
                segments = [Segment(f"{ours}.{p}", 0, out_features[f"{ours}.{p}"]) for p in parts]
                layers.append(_layer(f"{original}.{o}", segments))
    return KeyMap("hunyuanvideo", layers, peft_names=True)
