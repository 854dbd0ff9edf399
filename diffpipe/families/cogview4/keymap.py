"""Key map of family ``cogview4``: diffusers ``CogView4Transformer2DModel`` <-> THUDM's (SAT) checkpoint.

Names follow the transformer of THUDM's SwissArmyTransformer checkpoint (under
``model.diffusion_model.``), the naming diffusers' conversion script for
CogView4 reads: each block ``transformer.layers.N`` fuses q, k, v into
``attention.query_key_value`` (all q rows, then k, then v), has
``attention.dense`` (ours ``attn1.to_out.0``) and ``mlp.dense_h_to_4h`` /
``mlp.dense_4h_to_h`` (ours ``ff.net.0.proj`` / ``ff.net.2``); its modulation
sits outside the block as ``mixins.adaln.adaln_modules.N.1`` (ours
``norm1.linear``, rows in the same order). Outside the blocks:
``mixins.patch_embed.proj`` / ``text_proj``, ``time_embed.0/2`` (ours
``time_condition_embed.timestep_embedder.linear_1/2``), ``label_emb.0.0/0.2``
(ours ``time_condition_embed.condition_embedder.linear_1/2``),
``mixins.final_layer.linear`` (ours ``proj_out``) and
``mixins.final_layer.adaln.1``, which holds (shift, scale) where diffusers'
``norm_out.linear`` holds (scale, shift): one module in two segments, halves
swapped. kohya names are ``lora_unet_`` + the original path (no kohya trainer
covers CogView4).

THUDM's Megatron checkpoints name the same layers otherwise
(``decoder.layers.N.self_attention.linear_qkv`` with q, k, v interleaved per
head, ``adaln_final``, ``output_projector``, ...); this table does not cover
them. ComfyUI's source has no CogView4 model, and diffusers' CogView4 pipeline reads
only its own (diffusers-named) LoRAs: ``diffpipe import-lora`` reads these
files, alpha included.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffusers import CogView4Transformer2DModel

from diffpipe.models.keymap import KeyMap, Layer, Segment, kohya_name, swapped_halves
from diffpipe.models.spec import Kohya

DENOISER = CogView4Transformer2DModel
KOHYA = Kohya("cogview4", "cogview4/lora", "https://github.com/THUDM/CogView4")

# Outside the blocks: original -> ours.
TOP_LEVEL = {
    "mixins.patch_embed.proj": "patch_embed.proj",
    "mixins.patch_embed.text_proj": "patch_embed.text_proj",
    "time_embed.0": "time_condition_embed.timestep_embedder.linear_1",
    "time_embed.2": "time_condition_embed.timestep_embedder.linear_2",
    "label_emb.0.0": "time_condition_embed.condition_embedder.linear_1",
    "label_emb.0.2": "time_condition_embed.condition_embedder.linear_2",
    "mixins.final_layer.linear": "proj_out",
}
# One block: original suffix (under ``transformer.layers.N``) -> ours (under ``transformer_blocks.N``).
BLOCK = {
    "attention.dense": "attn1.to_out.0",
    "mlp.dense_h_to_4h": "ff.net.0.proj",
    "mlp.dense_4h_to_h": "ff.net.2",
}
QKV = ("attn1.to_q", "attn1.to_k", "attn1.to_v")


def _layer(original: str, segments: list[Segment]) -> Layer:
    return Layer(original, kohya_name(original), tuple(segments))


def _whole(original: str, ours: str, out_features: Mapping[str, int]) -> Layer:
    return _layer(original, [Segment(ours, 0, out_features[ours])])


def build(config: Mapping[str, Any], out_features: Mapping[str, int]) -> KeyMap:
    """The table for a transformer with this config; ``out_features``: its module sizes."""
    layers = [_whole(o, d, out_features) for o, d in TOP_LEVEL.items() if d in out_features]
    modulation = swapped_halves("norm_out.linear", out_features["norm_out.linear"])  # (scale, shift) vs (shift, scale)
    layers.append(_layer("mixins.final_layer.adaln.1", modulation))
    for i in range(config["num_layers"]):
        original, ours = f"transformer.layers.{i}", f"transformer_blocks.{i}"
        layers.append(
            _layer(
                f"{original}.attention.query_key_value",
                [Segment(f"{ours}.{p}", 0, out_features[f"{ours}.{p}"]) for p in QKV],
            )
        )
        for o, d in BLOCK.items():
            if f"{ours}.{d}" in out_features:
                layers.append(_whole(f"{original}.{o}", f"{ours}.{d}", out_features))
        if f"{ours}.norm1.linear" in out_features:
            layers.append(_whole(f"mixins.adaln.adaln_modules.{i}.1", f"{ours}.norm1.linear", out_features))
    return KeyMap("cogview4", layers)
