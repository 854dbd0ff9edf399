"""Key map of family ``sdxl``: diffusers ``UNet2DConditionModel`` <-> the original (SGM) UNet.

The SGM UNet numbers its blocks like SD's LDM UNet, so the table is
``sd.module_pairs`` (which already covers SDXL's deeper transformer stacks,
``transformer_layers_per_block``, and its added-conditioning MLP
``add_embedding`` -> ``label_emb.0.0`` / ``label_emb.0.2``). kohya names differ
from SD 1.x: sd-scripts trains SDXL on the SGM UNet, so its names are
``lora_unet_`` + the original path (``lora_unet_input_blocks_4_1_...``), the
names diffusers' SDXL ``load_lora_weights`` renumbers with the UNet config.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffusers import UNet2DConditionModel

from diffpipe.families.sd.keymap import unet_table
from diffpipe.models.keymap import KeyMap
from diffpipe.models.spec import Kohya

DENOISER = UNet2DConditionModel
KOHYA = Kohya("sdxl_base_v1-0", "stable-diffusion-xl-v1-base/lora", "https://github.com/Stability-AI/generative-models")


def build(config: Mapping[str, Any], out_features: Mapping[str, int]) -> KeyMap:
    return unet_table("sdxl", config, out_features, kohya_from_original=True)
