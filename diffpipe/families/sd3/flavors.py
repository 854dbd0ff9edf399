"""``sd3``: the tiny flavor's configs and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.models import tiny
from diffpipe.models.spec import Published

# -- tiny flavor ----------------------------------------
TINY_TRANSFORMER = {
    "sample_size": 32,
    "patch_size": 2,
    "in_channels": 4,
    "out_channels": 4,
    "num_layers": 2,
    "attention_head_dim": 8,
    "num_attention_heads": 4,
    "caption_projection_dim": 32,
    "joint_attention_dim": 64,  # = T5 width = the two CLIP widths side by side
    "pooled_projection_dim": 64,  # the two CLIP projections concatenated
    "pos_embed_max_size": 32,
}

# SD3's normalisation, so it is not the identity.
TINY_VAE = tiny.kl_vae(quant_conv=False, scaling_factor=1.5305, shift_factor=0.0609)

TINY_T5 = {**tiny.T5, "d_model": 64}

TINY_T5_LENGTH = 32

TINY_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0}


SD3_MEDIUM = {
    "sample_size": 128,
    "num_layers": 24,
    "num_attention_heads": 24,
    "caption_projection_dim": 1536,
    "pos_embed_max_size": 192,
}


SD35_LARGE = {
    "sample_size": 128,
    "num_layers": 38,
    "num_attention_heads": 38,
    "caption_projection_dim": 2432,
    "pos_embed_max_size": 192,
    "qk_norm": "rms_norm",
}


SD3_TEXT = {"prompt_embeds": (333, 4096), "pooled_prompt_embeds": (2048,)}


#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "sd3-medium", "sd3", "SD3Transformer2DModel", SD3_MEDIUM, 2.0e9, 2,
        "stable-diffusion-3-medium model card: 2 billion parameter MMDiT",
        text=SD3_TEXT, latent_channels=16,
    ),
    Published(
        "sd3.5-large", "sd3", "SD3Transformer2DModel", SD35_LARGE, 8.1e9, 2,
        "stable-diffusion-3.5-large model card: 8.1 billion parameters",
        text=SD3_TEXT, latent_channels=16,
    ),
]
