"""Key map of family ``auraflow``: diffusers ``AuraFlowTransformer2DModel`` <-> the original checkpoint.

Names follow ``convert_auraflow_transformer_checkpoint_to_diffusers`` in diffusers' ``single_file_utils.py``:
``double_layers.N`` (MMDiT blocks: image attention ``attn.w2q/w2k/w2v/w2o``, text attention
``attn.w1q/w1k/w1v/w1o``, feed-forwards ``mlpX``/``mlpC`` with ``c_fc1/c_fc2/c_proj``, modulations
``modX.1``/``modC.1``), ``single_layers.N`` (``attn.w1*``, ``mlp.*``, ``modCX.1``), ``cond_seq_linear``,
``t_embedder.mlp.0/2``, ``init_x_linear`` (patch embedding) and ``final_linear``. Nothing is fused; the
final modulation ``modF.1`` stores (shift, scale) where diffusers stores (scale, shift): one module in two
segments, halves swapped. kohya names are ``lora_unet_`` + the original path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffusers import AuraFlowTransformer2DModel

from diffpipe.models.keymap import KeyMap, layer, swapped_halves, whole_layers
from diffpipe.models.spec import Kohya

DENOISER = AuraFlowTransformer2DModel
#: No kohya-family trainer names it: the metadata says what the file is in the same scheme.
KOHYA = Kohya("auraflow", "auraflow/lora", "https://huggingface.co/fal/AuraFlow")

TOP_LEVEL = {
    "cond_seq_linear": "context_embedder",
    "t_embedder.mlp.0": "time_step_proj.linear_1",
    "t_embedder.mlp.2": "time_step_proj.linear_2",
    "init_x_linear": "pos_embed.proj",
    "final_linear": "proj_out",
}
_FF = {"c_fc1": "linear_1", "c_fc2": "linear_2", "c_proj": "out_projection"}
DOUBLE = {
    **{f"mlpX.{o}": f"ff.{d}" for o, d in _FF.items()},
    **{f"mlpC.{o}": f"ff_context.{d}" for o, d in _FF.items()},
    "modX.1": "norm1.linear",
    "modC.1": "norm1_context.linear",
    "attn.w2q": "attn.to_q", "attn.w2k": "attn.to_k", "attn.w2v": "attn.to_v", "attn.w2o": "attn.to_out.0",
    "attn.w1q": "attn.add_q_proj", "attn.w1k": "attn.add_k_proj", "attn.w1v": "attn.add_v_proj",
    "attn.w1o": "attn.to_add_out",
}
SINGLE = {
    **{f"mlp.{o}": f"ff.{d}" for o, d in _FF.items()},
    "modCX.1": "norm1.linear",
    "attn.w1q": "attn.to_q", "attn.w1k": "attn.to_k", "attn.w1v": "attn.to_v", "attn.w1o": "attn.to_out.0",
}


def build(config: Mapping[str, Any], out_features: Mapping[str, int]) -> KeyMap:
    """The table for a transformer with this config; ``out_features``: its module sizes."""
    layers = whole_layers(TOP_LEVEL, out_features)
    layers.append(layer("modF.1", swapped_halves("norm_out.linear", out_features["norm_out.linear"])))
    for i in range(config["num_mmdit_layers"]):
        pairs = {f"double_layers.{i}.{o}": f"joint_transformer_blocks.{i}.{d}" for o, d in DOUBLE.items()}
        layers += whole_layers(pairs, out_features)
    for i in range(config["num_single_dit_layers"]):
        pairs = {f"single_layers.{i}.{o}": f"single_transformer_blocks.{i}.{d}" for o, d in SINGLE.items()}
        layers += whole_layers(pairs, out_features)
    return KeyMap("auraflow", layers)
