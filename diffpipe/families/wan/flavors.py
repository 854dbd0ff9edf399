"""``wan``: the tiny flavor's configs and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.models import tiny
from diffpipe.models.spec import Published, published_series

# -- tiny flavor ----------------------------------------
TINY_VAE = tiny.WAN_VAE

TINY_TRANSFORMER = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 12,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 32,
    "freq_dim": 256,
    "ffn_dim": 32,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 32,
}

# Wan 2.2's VAE: residual blocks, 2x2 pixel patches in and out (12 channels), 48 latent channels, 16x spatial.
TINY_VAE_22 = {
    "base_dim": 8,
    "decoder_base_dim": 8,
    "z_dim": 48,
    "dim_mult": [1, 1, 1, 1],
    "num_res_blocks": 1,
    "temperal_downsample": [False, True, True],
    "is_residual": True,
    "in_channels": 12,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_temporal": 4,
    "scale_factor_spatial": 16,
    # Fixed non-trivial statistics, so the normalisation direction is exercised.
    "latents_mean": [round(0.1 * ((i % 7) - 3), 2) for i in range(48)],
    "latents_std": [round(1.0 + 0.1 * (i % 5), 2) for i in range(48)],
}

TINY_UMT5 = tiny.T5

TINY_LENGTH = 32


_wan = published_series("wan", "WanTransformer3DModel", text={"prompt_embeds": (512, 4096)}, latent_channels=16)
#: Wan 2.1 / 2.2's 14B transformer (dim 5120); the I2V variants widen its input and add image conditioning.
WAN_14B = {"num_attention_heads": 40, "attention_head_dim": 128, "ffn_dim": 13824, "num_layers": 40}
#: Wan 2.1 I2V 14B: 36 input channels, a 1280-dim CLIP image embedder and image key/value projections.
WAN_14B_I2V = {**WAN_14B, "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120}

#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    _wan("wan2.1-t2v-1.3b", {"num_attention_heads": 12, "attention_head_dim": 128, "ffn_dim": 8960, "num_layers": 30},
         1.42e9, 3, "Wan-AI/Wan2.1-T2V-1.3B(-Diffusers): dim 1536, 12 heads, ffn 8960, 30 layers; 1.42B parameters "
         "in its transformer weights (the model card's headline: '1.3B')", variant="2.1"),
    _wan("wan2.2-ti2v-5b", {"num_attention_heads": 24, "attention_head_dim": 128, "ffn_dim": 14336, "num_layers": 30,
                            "in_channels": 48, "out_channels": 48},
         5e9, 1, "Wan-AI/Wan2.2-TI2V-5B(-Diffusers) model card: 5B dense model (dim 3072, 30 layers, 48-channel "
         "Wan2.2-VAE with 16x16 spatial compression)", latent_channels=48, vae_factor=16, variant="2.2-5b"),
    _wan("wan2.2-t2v-a14b", WAN_14B, 14e9, 2,
         "Wan-AI/Wan2.2-T2V-A14B(-Diffusers) model card: two 14B experts (high and low noise), 14B active "
         "per step; each expert (transformer, transformer_2) is this denoiser", variant="2.2-a14b"),
    _wan("wan2.2-i2v-a14b", {**WAN_14B, "in_channels": 36}, 14e9, 2,
         "Wan-AI/Wan2.2-I2V-A14B(-Diffusers) model card: two 14B experts (high and low noise), 14B active per "
         "step; each expert is the T2V-A14B denoiser reading 36 input channels (noisy, mask and condition "
         "latents), without image embedder", variant="2.2-i2v-a14b"),
    _wan("wan2.1-i2v-14b", WAN_14B_I2V, 16.39e9, 4,
         "Wan-AI/Wan2.1-I2V-14B-480P(-Diffusers) transformer config (dim 5120, 40 heads, ffn 13824, 40 layers, "
         "36 input channels, 1280-dim CLIP image embedder with image key/value projections in every block): "
         "the 14B T2V transformer plus about 2.1B of image-conditioning weights (headline: '14B')",
         variant="2.1-i2v"),
    _wan("wan2.1-flf2v-14b", {**WAN_14B_I2V, "pos_embed_seq_len": 514}, 16.40e9, 4,
         "Wan-AI/Wan2.1-FLF2V-14B-720P(-Diffusers) transformer config: the Wan 2.1 I2V 14B transformer whose "
         "image embedder adds a position embedding over two CLIP sequences (2 x 257 tokens: the first and "
         "the last frame); headline '14B'", variant="2.1-flf2v"),
]
