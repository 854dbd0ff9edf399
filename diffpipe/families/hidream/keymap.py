"""Key map of family ``hidream``: diffusers ``HiDreamImageTransformer2DModel`` <-> the original checkpoint.

HiDream-I1's checkpoint and ComfyUI's HiDream model use diffusers names
(diffusers' single-file loader only strips ``model.diffusion_model.``): every
layer, MoE experts included, is its own module under the same path. diffusers'
HiDream loader (``_convert_non_diffusers_hidream_lora_to_diffusers``) renames
``diffusion_model.*`` and then reads PEFT tensor names only and ignores alpha,
so the ComfyUI file names its tensors ``lora_A`` / ``lora_B`` (ComfyUI reads
them too), and every layer carries its scale in ``up`` (alpha = rank, which
ComfyUI and A1111 also assume when ``.alpha`` is missing) and no ``.alpha`` key,
which that loader would report as unexpected. kohya names are ``lora_unet_`` +
the path (what ComfyUI maps for every model; no kohya trainer covers HiDream).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffusers import HiDreamImageTransformer2DModel

from diffpipe.models.keymap import KeyMap, kohya_name, plain
from diffpipe.models.spec import Kohya

DENOISER = HiDreamImageTransformer2DModel
KOHYA = Kohya("hidream", "hidream-i1/lora", "https://github.com/HiDream-ai/HiDream-I1")


def build(config: Mapping[str, Any], out_features: Mapping[str, int]) -> KeyMap:
    layers = [plain(m, m, n, kohya_name(m), fold_scale=True, alpha_key=False) for m, n in out_features.items()]
    return KeyMap("hidream", layers, peft_names=True)
