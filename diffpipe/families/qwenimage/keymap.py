"""Key map of family ``qwenimage``: diffusers ``QwenImageTransformer2DModel`` <-> the original checkpoint.

Qwen-Image was released with diffusers names, and ComfyUI's Qwen-Image model
uses them too (diffusers' single-file loader maps the checkpoint unchanged):
every layer is its own module, under the same path. kohya names
(musubi-tuner) are ``lora_unet_`` + that path; diffusers'
``_convert_non_diffusers_qwen_lora_to_diffusers`` reads both, alpha included.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffusers import QwenImageTransformer2DModel

from diffpipe.models.keymap import KeyMap, same_names
from diffpipe.models.spec import Kohya

DENOISER = QwenImageTransformer2DModel
KOHYA = Kohya("qwen_image", "Qwen-Image/lora", "https://github.com/QwenLM/Qwen-Image")


def build(config: Mapping[str, Any], out_features: Mapping[str, int]) -> KeyMap:
    return same_names("qwenimage", out_features)
