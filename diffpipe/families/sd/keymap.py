"""Key map of family ``sd``: diffusers ``UNet2DConditionModel`` <-> the original (LDM) UNet.

Generated from the UNet config, block by block, following the layout that
diffusers' single-file loader reads (``convert_ldm_unet_checkpoint`` in
``diffusers/loaders/single_file_utils.py``): ``input_blocks`` count one slot
for ``conv_in``, one per layer and one per downsampler; ``output_blocks`` hold
``layers + 1`` slots per up block with the upsampler in the last one; ResNet
layers rename their convolutions and time projection, transformer internals
keep their names. kohya names follow sd-scripts for SD 1.x/2.x, which trains
on the diffusers UNet: ``lora_unet_`` + our module path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffusers import UNet2DConditionModel

from diffpipe.models import targets
from diffpipe.models.keymap import KeyMap, kohya_name, plain
from diffpipe.models.spec import Kohya

DENOISER = UNet2DConditionModel

_GENERATIVE_MODELS = "https://github.com/Stability-AI/generative-models"


def KOHYA(unet_config: Mapping[str, Any]) -> Kohya:  # every key map's KOHYA; here a function
    """SD 2.x UNets cross-attend to 1024-wide OpenCLIP states, SD 1.x to 768-wide CLIP ones."""
    if unet_config.get("cross_attention_dim") == 1024:
        return Kohya("sd_v2", "stable-diffusion-v2-512/lora", _GENERATIVE_MODELS)
    return Kohya("sd_v1", "stable-diffusion-v1/lora", _GENERATIVE_MODELS)


# ResNet block: our name -> original name (ldm ``ResBlock``).
RESNET = {
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}
# Transformer block internals: same names in both (ldm ``SpatialTransformer``).
TRANSFORMER_BLOCK = [*targets.attention("attn1"), *targets.attention("attn2"), *targets.feed_forward()]
TOP_LEVEL = {
    "conv_in": "input_blocks.0.0",
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "add_embedding.linear_1": "label_emb.0.0",
    "add_embedding.linear_2": "label_emb.0.2",
    "conv_out": "out.2",
}


def _per_block(value: Any, n: int) -> list[int]:
    return list(value) if isinstance(value, list | tuple) else [value] * n


def _resnet(ours: str, original: str) -> dict[str, str]:
    return {f"{ours}.{k}": f"{original}.{v}" for k, v in RESNET.items()}


def _attention(ours: str, original: str, depth: int) -> dict[str, str]:
    pairs = {f"{ours}.proj_in": f"{original}.proj_in", f"{ours}.proj_out": f"{original}.proj_out"}
    for k in range(depth):
        for name in TRANSFORMER_BLOCK:
            pairs[f"{ours}.transformer_blocks.{k}.{name}"] = f"{original}.transformer_blocks.{k}.{name}"
    return pairs


def module_pairs(config: Mapping[str, Any]) -> dict[str, str]:
    """Every LoRA-able module name of the UNet -> its original checkpoint path."""
    down_types = list(config["down_block_types"])
    up_types = list(config["up_block_types"])
    n = len(down_types)
    layers = _per_block(config["layers_per_block"], n)
    depth = _per_block(config.get("transformer_layers_per_block", 1), n)
    pairs = dict(TOP_LEVEL)

    slot = 1  # input_blocks.0 is conv_in
    for i, kind in enumerate(down_types):
        for j in range(layers[i]):
            pairs |= _resnet(f"down_blocks.{i}.resnets.{j}", f"input_blocks.{slot}.0")
            if kind.startswith("CrossAttn"):
                pairs |= _attention(f"down_blocks.{i}.attentions.{j}", f"input_blocks.{slot}.1", depth[i])
            slot += 1
        if i < n - 1:
            pairs[f"down_blocks.{i}.downsamplers.0.conv"] = f"input_blocks.{slot}.0.op"
            slot += 1

    pairs |= _resnet("mid_block.resnets.0", "middle_block.0")
    pairs |= _attention("mid_block.attentions.0", "middle_block.1", depth[-1])
    pairs |= _resnet("mid_block.resnets.1", "middle_block.2")

    up_layers, up_depth = list(reversed(layers)), list(reversed(depth))
    slot = 0
    for i, kind in enumerate(up_types):
        attn = kind.startswith("CrossAttn")
        for j in range(up_layers[i] + 1):
            pairs |= _resnet(f"up_blocks.{i}.resnets.{j}", f"output_blocks.{slot}.0")
            if attn:
                pairs |= _attention(f"up_blocks.{i}.attentions.{j}", f"output_blocks.{slot}.1", up_depth[i])
            slot += 1
        if i < n - 1:
            pairs[f"up_blocks.{i}.upsamplers.0.conv"] = f"output_blocks.{slot - 1}.{2 if attn else 1}.conv"
    return pairs


def unet_table(
    family: str, config: Mapping[str, Any], out_features: Mapping[str, int], *, kohya_from_original: bool
) -> KeyMap:
    """The table for a UNet with this config; ``out_features``: the UNet's module sizes.

    Names the config implies but the model lacks (``conv_shortcut`` where the
    channels do not change, ``add_embedding`` outside SDXL) are left out.
    ``kohya_from_original``: kohya names follow the original path (SDXL) rather
    than ours (SD 1.x/2.x).
    """
    layers = [
        plain(original, ours, out_features[ours], kohya_name(original if kohya_from_original else ours))
        for ours, original in module_pairs(config).items()
        if ours in out_features
    ]
    return KeyMap(family, layers)


def build(config: Mapping[str, Any], out_features: Mapping[str, int]) -> KeyMap:
    return unet_table("sd", config, out_features, kohya_from_original=False)
