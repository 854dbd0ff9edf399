"""Key map of family ``ltxvideo``: diffusers ``LTXVideoTransformer3DModel`` <-> the original (LTX-Video) checkpoint.

Names follow ``convert_ltx_transformer_checkpoint_to_diffusers`` in diffusers'
``single_file_utils.py``: the original uses diffusers' block names
(``transformer_blocks.N.attn1.to_q``, ``ff.net.0.proj``, ...) except the patch
embedding ``patchify_proj`` (ours ``proj_in``) and the timestep modulation
``adaln_single`` (ours ``time_embed``); ComfyUI's LTX-Video model uses the
original names. kohya names are ``lora_unet_`` + the original path (what
ComfyUI maps for every model; no kohya trainer covers LTX-Video).

diffusers' LTX-Video loader (``_convert_non_diffusers_ltxv_lora_to_diffusers``)
only swaps ``diffusion_model.`` for ``transformer.``, reads PEFT tensor names
and no alpha (and so misses ``patchify_proj`` and ``adaln_single``, which it
does not rename): the ComfyUI file names its tensors ``lora_A`` / ``lora_B``
(ComfyUI reads them too) and every layer carries its scale in ``up`` with no
``.alpha`` key (alpha = rank, what ComfyUI assumes when it is missing).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffusers import LTXVideoTransformer3DModel

from diffpipe.models.keymap import KeyMap, kohya_name, plain
from diffpipe.models.spec import Kohya

DENOISER = LTXVideoTransformer3DModel
KOHYA = Kohya("ltx_video", "ltx-video/lora", "https://github.com/Lightricks/LTX-Video")

# Our top-level prefix -> the original's; every other name is the same.
RENAMED = {"proj_in": "patchify_proj", "time_embed": "adaln_single"}


def original_name(module: str, renamed: Mapping[str, str] = RENAMED) -> str:
    head, dot, rest = module.partition(".")
    return renamed.get(head, head) + dot + rest


def renamed_keymap(family: str, renamed: Mapping[str, str], out_features: Mapping[str, int]) -> KeyMap:
    """The key map of an LTX model whose original names are ours with the top-level prefixes ``renamed``:
    PEFT tensor names, the scale folded into ``up``, no ``.alpha`` key (what diffusers' LTX converters read)."""
    layers = []
    for module, size in out_features.items():
        original = original_name(module, renamed)
        layers.append(plain(original, module, size, kohya_name(original), fold_scale=True, alpha_key=False))
    return KeyMap(family, layers, peft_names=True)


def build(config: Mapping[str, Any], out_features: Mapping[str, int]) -> KeyMap:
    return renamed_keymap("ltxvideo", RENAMED, out_features)
