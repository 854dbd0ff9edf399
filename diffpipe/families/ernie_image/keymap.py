"""Key map of family ``ernie-image``: diffusers ``ErnieImageTransformer2DModel`` <-> the original checkpoint.

ERNIE-Image's checkpoint uses diffusers' module names: diffusers' single-file converter
(``convert_ernie_image_transformer_checkpoint_to_diffusers``) only strips a ``model.diffusion_model.``
prefix. So every layer is its own module under the same path (``diffusion_model.`` + it in the
ComfyUI file); kohya names are ``lora_unet_`` + that path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffusers import ErnieImageTransformer2DModel

from diffpipe.models.keymap import KeyMap, same_names
from diffpipe.models.spec import Kohya

DENOISER = ErnieImageTransformer2DModel
#: No kohya-family trainer names it: the metadata says what the file is in the same scheme.
KOHYA = Kohya("ernie_image", "ernie-image/lora", "https://huggingface.co/baidu/ERNIE-Image")


def build(config: Mapping[str, Any], out_features: Mapping[str, int]) -> KeyMap:
    return same_names("ernie-image", out_features)
