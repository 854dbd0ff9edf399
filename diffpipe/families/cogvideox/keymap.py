"""Key map of family ``cogvideox``: diffusers ``CogVideoXTransformer3DModel`` <-> ComfyUI's CogVideoX model.

ComfyUI runs CogVideoX with its own model (``comfy/ldm/cogvideo/model.py``,
the 1.0 and 1.5 layouts, the 1.5 image-to-video ``ofs`` embedding included),
whose module names are what its LoRA loader maps (``diffusion_model.<path>``
and ``lora_unet_<path with _>``, the rule it applies to every model). Those
names are the original naming here. They split every layer as diffusers does
(no fused layers, no reordered rows): in each block ``blocks.N`` the
attention's ``q``, ``k``, ``v`` and ``attn_out`` (ours ``attn1.to_q`` ...
``attn1.to_out.0``), the feed-forward ``ff_proj`` / ``ff_out`` (ours
``ff.net.0.proj`` / ``ff.net.2``) and the modulations ``norm1.linear`` /
``norm2.linear`` (6 x inner rows, the same order); outside the blocks
``time_embedding_linear_1/2`` and, for CogVideoX 1.5 image-to-video,
``ofs_embedding_linear_1/2`` (ours ``time_embedding.linear_1/2``,
``ofs_embedding.linear_1/2``); ``patch_embed.proj`` (a Conv2d, a Linear with
temporal patches), ``patch_embed.text_proj``, ``norm_out.linear`` (shift,
scale, as diffusers) and ``proj_out`` keep their names. kohya names are
``lora_unet_`` + that path (what ComfyUI maps; no kohya trainer covers
CogVideoX).

THUDM's own (SAT) checkpoints, under ``model.diffusion_model.``, name the
layers differently and fuse them: ``transformer.layers.N.attention.query_key_value``
(q, k, v stacked), ``attention.dense``, ``mlp.dense_h_to_4h`` /
``dense_4h_to_h``, one ``mixins.adaln_layer.adaLN_modulations.N.1`` per block
holding both modulations (12 chunks: norm1's first three, norm2's first
three, norm1's last three, norm2's last three), ``time_embed.0/2``,
``mixins.patch_embed.*``, ``mixins.final_layer.linear`` and
``mixins.final_layer.adaLN_modulation.1``. ComfyUI does not read those names,
so the files follow ComfyUI's. diffusers' CogVideoX pipeline reads only its
own (diffusers-named) LoRAs; ComfyUI and ``diffpipe import-lora`` read these,
alpha included.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffusers import CogVideoXTransformer3DModel

from diffpipe.models.keymap import KeyMap, kohya_name, plain
from diffpipe.models.spec import Kohya

DENOISER = CogVideoXTransformer3DModel
KOHYA = Kohya("cogvideox", "cogvideox/lora", "https://github.com/THUDM/CogVideo")

# Outside the blocks: our name -> ComfyUI's.
TOP_LEVEL = {
    "patch_embed.proj": "patch_embed.proj",
    "patch_embed.text_proj": "patch_embed.text_proj",
    "time_embedding.linear_1": "time_embedding_linear_1",
    "time_embedding.linear_2": "time_embedding_linear_2",
    "ofs_embedding.linear_1": "ofs_embedding_linear_1",
    "ofs_embedding.linear_2": "ofs_embedding_linear_2",
    "norm_out.linear": "norm_out.linear",
    "proj_out": "proj_out",
}
# One block: our suffix (under ``transformer_blocks.N``) -> ComfyUI's (under ``blocks.N``).
BLOCK = {
    "norm1.linear": "norm1.linear",
    "attn1.to_q": "q",
    "attn1.to_k": "k",
    "attn1.to_v": "v",
    "attn1.to_out.0": "attn_out",
    "norm2.linear": "norm2.linear",
    "ff.net.0.proj": "ff_proj",
    "ff.net.2": "ff_out",
}


def original_name(module: str) -> str | None:
    """ComfyUI's name for one of our modules (None: not a layer ComfyUI's model has)."""
    if module in TOP_LEVEL:
        return TOP_LEVEL[module]
    stack, _, rest = module.partition(".")
    index, _, suffix = rest.partition(".")
    if stack == "transformer_blocks" and index.isdigit() and suffix in BLOCK:
        return f"blocks.{index}.{BLOCK[suffix]}"
    return None


def build(config: Mapping[str, Any], out_features: Mapping[str, int]) -> KeyMap:
    """The table for a transformer with this config; ``out_features``: its module sizes."""
    layers = []
    for module, size in out_features.items():
        original = original_name(module)
        if original is not None:
            layers.append(plain(original, module, size, kohya_name(original)))
    return KeyMap("cogvideox", layers)
