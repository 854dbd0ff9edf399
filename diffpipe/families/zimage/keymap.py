"""Key map of family ``zimage``: diffusers ``ZImageTransformer2DModel`` <-> the LoRA files tools exchange.

Z-Image LoRAs circulate with diffusers module names (the original checkpoint fuses q, k and v into
``attention.qkv``; ComfyUI maps the separate ``to_q/to_k/to_v`` names of a LoRA onto the rows of that
fused layer when it loads one under ``diffusion_model.``). So every layer is its own module under the
same path, as for Qwen-Image; kohya names are ``lora_unet_`` + that path. diffusers'
``_convert_non_diffusers_z_image_lora_to_diffusers`` reads both, alpha included.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffusers import ZImageTransformer2DModel

from diffpipe.models.keymap import KeyMap, same_names
from diffpipe.models.spec import Kohya

DENOISER = ZImageTransformer2DModel
KOHYA = Kohya("z_image", "Z-Image/lora", "https://github.com/Tongyi-MAI/Z-Image")


def build(config: Mapping[str, Any], out_features: Mapping[str, int]) -> KeyMap:
    return same_names("zimage", out_features)
