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

ComfyUI builds HunyuanVideo from Flux's layers and renames the checkpoint on load
(``img_mod.linear`` -> ``img_mod.lin``, ``img_attn_qkv`` -> ``img_attn.qkv``, MLPs
``fc1`` / ``fc2`` -> ``0`` / ``2``, the embedders' ``mlp.0`` / ``linear_1`` ->
``in_layer``, ...: ``COMFY_BLOCK`` / ``COMFY_TOP``). Its LoRA loader maps
``diffusion_model.<name>`` back to the original names for the block layers only,
and ``lora_unet_<name>`` only from its own names. So the ComfyUI file names the
embedders by ComfyUI's names (``Layer.comfy``; diffusers' converter reads the
original ones: use the diffusers file there), and kohya names are ``lora_unet_`` +
ComfyUI's name (musubi-tuner's own files use the original names, which ComfyUI
does not place for the MLPs and modulations; ``diffpipe import-lora`` reads both).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffusers import HunyuanVideoTransformer3DModel

from diffpipe.models.keymap import KeyMap, Layer, Segment, kohya_name, swapped_halves, whole_layers
from diffpipe.models.spec import Kohya

DENOISER = HunyuanVideoTransformer3DModel
KOHYA = Kohya("hunyuan_video", "hunyuan-video/lora", "https://github.com/Tencent/HunyuanVideo")

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


# ComfyUI's names for the layers it renames: per block (original suffix -> ComfyUI's), top level.
COMFY_BLOCK = {
    "img_mod.linear": "img_mod.lin",
    "txt_mod.linear": "txt_mod.lin",
    "img_attn_qkv": "img_attn.qkv",
    "txt_attn_qkv": "txt_attn.qkv",
    "img_attn_proj": "img_attn.proj",
    "txt_attn_proj": "txt_attn.proj",
    "img_mlp.fc1": "img_mlp.0",
    "img_mlp.fc2": "img_mlp.2",
    "txt_mlp.fc1": "txt_mlp.0",
    "txt_mlp.fc2": "txt_mlp.2",
    "modulation.linear": "modulation.lin",
    "self_attn_qkv": "self_attn.qkv",
    "self_attn_proj": "self_attn.proj",
    "mlp.fc1": "mlp.0",
    "mlp.fc2": "mlp.2",
}
COMFY_TOP = {
    "time_in.mlp.0": "time_in.in_layer",
    "time_in.mlp.2": "time_in.out_layer",
    "guidance_in.mlp.0": "guidance_in.in_layer",
    "guidance_in.mlp.2": "guidance_in.out_layer",
    "txt_in.t_embedder.mlp.0": "txt_in.t_embedder.in_layer",
    "txt_in.t_embedder.mlp.2": "txt_in.t_embedder.out_layer",
    "txt_in.c_embedder.linear_1": "txt_in.c_embedder.in_layer",
    "txt_in.c_embedder.linear_2": "txt_in.c_embedder.out_layer",
}


def comfy_model_name(original: str) -> str:
    """The layer's name in ComfyUI's HunyuanVideo model."""
    if original in COMFY_TOP:
        return COMFY_TOP[original]
    for suffix, renamed in COMFY_BLOCK.items():
        if original.endswith("." + suffix):
            return original.removesuffix(suffix) + renamed
    return original


def _layer(original: str, segments: list[Segment]) -> Layer:
    comfy = comfy_model_name(original)
    return Layer(original, kohya_name(comfy), tuple(segments), fold_scale=True, alpha_key=False,
                 comfy=comfy if original in COMFY_TOP else "")


def build(config: Mapping[str, Any], out_features: Mapping[str, int]) -> KeyMap:
    """The table for a transformer with this config; ``out_features``: its module sizes."""
    layers = whole_layers(TOP_LEVEL, out_features, _layer)
    modulation = swapped_halves("norm_out.linear", out_features["norm_out.linear"])  # (scale, shift) vs (shift, scale)
    layers.append(_layer("final_layer.adaLN_modulation.1", modulation))
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
