"""Key map of family ``qwenimage-edit``: Qwen-Image-Edit, ``qwenimage``'s table under its own name.

Qwen-Image-Edit is Qwen-Image's ``QwenImageTransformer2DModel`` (the control
image enters as extra tokens, no extra layers), released with diffusers names
that ComfyUI uses too: every layer is its own module under the same path,
kohya names ``lora_unet_`` + that path, and diffusers' Qwen-Image loader reads
both, alpha included.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffpipe.families.qwenimage import keymap as qwenimage
from diffpipe.models.keymap import KeyMap
from diffpipe.models.spec import Kohya

DENOISER = qwenimage.DENOISER
KOHYA = Kohya("qwen_image", "Qwen-Image-Edit/lora", "https://github.com/QwenLM/Qwen-Image")


def build(config: Mapping[str, Any], out_features: Mapping[str, int]) -> KeyMap:
    return KeyMap("qwenimage-edit", qwenimage.build(config, out_features).layers)
