"""Key map of family ``cosmos2``: diffusers ``CosmosTransformer3DModel`` <-> the original (Cosmos-Predict2) checkpoint.

Names follow the Cosmos 2.0 branch of ``convert_cosmos_transformer_checkpoint_to_diffusers``
in diffusers' ``single_file_utils.py``, without the checkpoint's ``net.``
prefix (which ComfyUI strips on load too): ``blocks.N.self_attn`` /
``cross_attn`` with ``q_proj``, ``k_proj``, ``v_proj``, ``output_proj``;
``mlp.layer1`` / ``layer2``; the AdaLN-LoRA modulations
``adaln_modulation_{self_attn,cross_attn,mlp}.1`` / ``.2``; outside the
blocks ``x_embedder.proj.1``, ``t_embedder.1.linear_1`` / ``linear_2`` and
``final_layer``. Every layer is one module, rows in order. kohya names are
``lora_unet_`` + the original path (what ComfyUI maps for every model; no
kohya trainer covers Cosmos-Predict2).

diffusers' Cosmos loader reads only its own (diffusers-named) LoRAs;
ComfyUI and ``diffpipe import-lora`` read these, alpha included.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffusers import CosmosTransformer3DModel

from diffpipe.models.keymap import KeyMap, kohya_name, plain
from diffpipe.models.spec import Kohya

DENOISER = CosmosTransformer3DModel
KOHYA = Kohya("cosmos_predict2", "cosmos-predict2/lora", "https://github.com/nvidia-cosmos/cosmos-predict2")

TOP_LEVEL = {
    "x_embedder.proj.1": "patch_embed.proj",
    "t_embedder.1.linear_1": "time_embed.t_embedder.linear_1",
    "t_embedder.1.linear_2": "time_embed.t_embedder.linear_2",
    "final_layer.adaln_modulation.1": "norm_out.linear_1",
    "final_layer.adaln_modulation.2": "norm_out.linear_2",
    "final_layer.linear": "proj_out",
}
BLOCK = {
    "adaln_modulation_self_attn.1": "norm1.linear_1",
    "adaln_modulation_self_attn.2": "norm1.linear_2",
    "adaln_modulation_cross_attn.1": "norm2.linear_1",
    "adaln_modulation_cross_attn.2": "norm2.linear_2",
    "adaln_modulation_mlp.1": "norm3.linear_1",
    "adaln_modulation_mlp.2": "norm3.linear_2",
    "mlp.layer1": "ff.net.0.proj",
    "mlp.layer2": "ff.net.2",
} | {
    f"{attn}.{o}": f"{ours}.{d}"
    for attn, ours in (("self_attn", "attn1"), ("cross_attn", "attn2"))
    for o, d in (("q_proj", "to_q"), ("k_proj", "to_k"), ("v_proj", "to_v"), ("output_proj", "to_out.0"))
}


def build(config: Mapping[str, Any], out_features: Mapping[str, int]) -> KeyMap:
    """The table for a transformer with this config; ``out_features``: its module sizes."""
    pairs = dict(TOP_LEVEL)
    for i in range(config["num_layers"]):
        pairs |= {f"blocks.{i}.{o}": f"transformer_blocks.{i}.{d}" for o, d in BLOCK.items()}
    layers = [plain(o, d, out_features[d], kohya_name(o)) for o, d in pairs.items() if d in out_features]
    return KeyMap("cosmos2", layers)
