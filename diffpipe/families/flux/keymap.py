"""Key map of family ``flux``: diffusers ``FluxTransformer2DModel`` <-> the original (BFL) checkpoint.

Names follow ``convert_flux_transformer_checkpoint_to_diffusers`` in
diffusers' ``single_file_utils.py``. The original fuses attention q, k, v into
one ``qkv`` linear per stream, and a single block's q, k, v and MLP input into
``linear1``; split sizes come from the model config (inner dim = heads x head
dim, MLP = 4 x inner, as ``FluxSingleTransformerBlock`` builds it). The final
modulation stores (shift, scale) where diffusers stores (scale, shift): one
module in two segments, halves swapped. kohya names (sd-scripts, as read by
diffusers' ``_convert_kohya_flux_lora_to_diffusers``) are ``lora_unet_`` + the
original path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from diffusers import FluxTransformer2DModel

from diffpipe.models.keymap import KeyMap, Layer, Segment, kohya_name, whole_layers
from diffpipe.models.spec import Kohya

DENOISER = FluxTransformer2DModel
KOHYA = Kohya("flux1", "flux-1-dev/lora", "https://github.com/black-forest-labs/flux")

MLP_RATIO = 4.0

# Plain layers of a double block: original suffix -> our suffix.
DOUBLE_PLAIN = {
    "img_mod.lin": "norm1.linear",
    "txt_mod.lin": "norm1_context.linear",
    "img_attn.proj": "attn.to_out.0",
    "txt_attn.proj": "attn.to_add_out",
    "img_mlp.0": "ff.net.0.proj",
    "img_mlp.2": "ff.net.2",
    "txt_mlp.0": "ff_context.net.0.proj",
    "txt_mlp.2": "ff_context.net.2",
}
# Fused layers of a double block: original suffix -> our q, k, v suffixes.
DOUBLE_FUSED = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}
SINGLE_PLAIN = {"modulation.lin": "norm.linear", "linear2": "proj_out"}
TOP_LEVEL = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
    "final_layer.linear": "proj_out",
}


# diffusers' ``_convert_kohya_flux_lora_to_diffusers`` reads ``final_layer.*`` without
# its alpha ("TODO: alphas"): those layers carry their scale in ``up`` instead.
FOLD_SCALE_PREFIX = "final_layer."


def _layer(original: str, segments: list[Segment]) -> Layer:
    return Layer(original, kohya_name(original), tuple(segments), original.startswith(FOLD_SCALE_PREFIX))


def double_blocks(count: int, inner: int, plain: Mapping[str, str], out_features: Mapping[str, int],
                  make: Callable[[str, list[Segment]], Layer]) -> list[Layer]:
    """The layers of ``count`` BFL double blocks: ``plain`` (original -> our suffix; absent modules skipped),
    then each stream's fused ``qkv`` (``DOUBLE_FUSED``, ``inner`` rows a part); ``make`` builds a layer.
    Shared with FLUX.2 (``flux2-klein``), whose double blocks have the same fused attention."""
    layers = []
    for i in range(count):
        ours, original = f"transformer_blocks.{i}", f"double_blocks.{i}"
        layers += whole_layers({f"{original}.{o}": f"{ours}.{d}" for o, d in plain.items()}, out_features, make)
        for o, parts in DOUBLE_FUSED.items():
            layers.append(make(f"{original}.{o}", [Segment(f"{ours}.{p}", 0, inner) for p in parts]))
    return layers


def transformer_layers(
    config: Mapping[str, Any], out_features: Mapping[str, int], top_level: Mapping[str, str]
) -> list[Layer]:
    """Layers of a BFL-style transformer: ``top_level`` (original -> ours), then the blocks.

    Shared with ``chroma``, whose blocks are Flux's without the modulation linears
    (absent modules are skipped) and whose final layer has no modulation.
    """
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    mlp = int(inner * MLP_RATIO)
    layers = whole_layers(top_level, out_features, _layer)
    if "norm_out.linear" in out_features:
        # norm_out.linear = (scale, shift); final_layer.adaLN_modulation.1 = (shift, scale).
        layers.append(
            _layer(
                "final_layer.adaLN_modulation.1",
                [Segment("norm_out.linear", inner, inner), Segment("norm_out.linear", 0, inner)],
            )
        )

    layers += double_blocks(config["num_layers"], inner, DOUBLE_PLAIN, out_features, _layer)

    for i in range(config["num_single_layers"]):
        ours, original = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        layers += whole_layers({f"{original}.{o}": f"{ours}.{d}" for o, d in SINGLE_PLAIN.items()}, out_features, _layer)
        sizes = {"attn.to_q": inner, "attn.to_k": inner, "attn.to_v": inner, "proj_mlp": mlp}
        layers.append(_layer(f"{original}.linear1", [Segment(f"{ours}.{p}", 0, n) for p, n in sizes.items()]))
    return layers


def build(config: Mapping[str, Any], out_features: Mapping[str, int]) -> KeyMap:
    """The table for a transformer with this config; ``out_features``: its module sizes."""
    return KeyMap("flux", transformer_layers(config, out_features, TOP_LEVEL))
