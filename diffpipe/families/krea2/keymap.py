"""Key map of family ``krea2``: diffusers ``Krea2Transformer2DModel`` <-> the original checkpoint.

The original names are those diffusers' single-file converter
(``convert_krea2_transformer_checkpoint_to_diffusers``) renames from, inverted here: ``first`` (image
input), ``tmlp.0/2`` and ``tproj.1`` (time), ``txtmlp.1/3`` (text input), ``txtfusion.`` (the text-fusion
stage), ``blocks.N`` with ``attn.wq/wk/wv/wo/gate`` and ``mlp.gate/up/down``, ``last.linear``. Nothing is
fused or reordered, so every layer is its own module. kohya names are ``lora_unet_`` + the original path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffusers import Krea2Transformer2DModel

from diffpipe.models.keymap import KeyMap, kohya_name, plain
from diffpipe.models.spec import Kohya

DENOISER = Krea2Transformer2DModel
#: No kohya-family trainer names it: the metadata says what the file is in the same scheme.
KOHYA = Kohya("krea2", "krea-2/lora", "https://github.com/huggingface/diffusers")

#: diffusers prefix -> original prefix (the converter's prefix table, inverted; at most one applies).
PREFIXES = (
    ("img_in.", "first."),
    ("time_embed.linear_1.", "tmlp.0."),
    ("time_embed.linear_2.", "tmlp.2."),
    ("time_mod_proj.", "tproj.1."),
    ("txt_in.linear_1.", "txtmlp.1."),
    ("txt_in.linear_2.", "txtmlp.3."),
    ("text_fusion.", "txtfusion."),
    ("transformer_blocks.", "blocks."),
    ("final_layer.linear.", "last.linear."),
)
#: diffusers -> original, anywhere in a name (the converter's block table, inverted).
BLOCK_NAMES = (
    (".attn.to_q.", ".attn.wq."),
    (".attn.to_k.", ".attn.wk."),
    (".attn.to_v.", ".attn.wv."),
    (".attn.to_out.0.", ".attn.wo."),
    (".attn.to_gate.", ".attn.gate."),
    (".ff.", ".mlp."),
)


def original_name(module: str) -> str:
    """A diffusers module path's name in the original checkpoint."""
    name = module + "."
    for new, old in PREFIXES:
        if name.startswith(new):
            name = old + name[len(new):]
            break
    for new, old in BLOCK_NAMES:
        name = name.replace(new, old)
    return name[:-1]


def build(config: Mapping[str, Any], out_features: Mapping[str, int]) -> KeyMap:
    return KeyMap("krea2", [plain(original_name(m), m, n, kohya_name(original_name(m)))
                            for m, n in out_features.items()])
