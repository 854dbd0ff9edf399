"""Tiny configs many families' debug flavors share (FIELD_NOTES: tiny configs).

A family's ``flavors.py`` builds its tiny components from these and overrides
what its published model does differently (scaling factors, widths), so a
change to a shared building block is made once.
"""

from __future__ import annotations

from typing import Any

#: A T5 (or UMT5) encoder of width 32: two layers, four heads.
T5: dict[str, Any] = {"d_model": 32, "d_kv": 8, "d_ff": 37, "num_layers": 2, "num_heads": 4,
                      "relative_attention_num_buckets": 8}

#: A Llama-style decoder of width 32 with grouped-query attention (two key/value heads).
LLAMA: dict[str, Any] = {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2}

#: A Gemma-style decoder: the Llama shape with an explicit head width.
GEMMA: dict[str, Any] = {**LLAMA, "head_dim": 8}

#: Wan 2.1's causal 3-D VAE (``AutoencoderKLWan``) at base width 3: 8x spatial, 4x temporal, 16 channels.
WAN_VAE: dict[str, Any] = {"base_dim": 3, "z_dim": 16, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1,
                           "temperal_downsample": [False, True, True]}


def kl_vae(*, levels: int = 2, latent_channels: int = 4, quant_conv: bool = True, **extra: Any) -> dict[str, Any]:
    """A tiny ``AutoencoderKL`` config: ``levels`` encoder levels (factor ``2 ** (levels - 1)``).

    Two levels use widths (32, 64); four levels use (8, 16, 16, 16) with one layer a
    block and 8 norm groups, so factor 8 stays cheap. ``quant_conv=False`` drops the
    quant convolutions as FLUX.1's and SD3's VAEs do; ``extra`` sets anything else
    (``scaling_factor``, ``shift_factor``).
    """
    if levels not in (2, 4):
        raise ValueError(f"tiny kl_vae has 2 or 4 levels, not {levels}")
    config: dict[str, Any] = {
        "block_out_channels": (32, 64) if levels == 2 else (8, 16, 16, 16),
        "in_channels": 3,
        "out_channels": 3,
        "down_block_types": ("DownEncoderBlock2D",) * levels,
        "up_block_types": ("UpDecoderBlock2D",) * levels,
        "latent_channels": latent_channels,
        "sample_size": 64,
    }
    if levels == 4:
        config |= {"layers_per_block": 1, "norm_num_groups": 8}
    if not quant_conv:
        config |= {"use_quant_conv": False, "use_post_quant_conv": False}
    return config | extra
