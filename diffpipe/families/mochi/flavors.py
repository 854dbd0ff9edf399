"""``mochi``: the tiny flavor's configs and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.models import _video as video
from diffpipe.models.spec import Published

# -- tiny flavor ----------------------------------------
TINY_VAE = {
    "latent_channels": 12,
    "out_channels": 3,
    "encoder_block_out_channels": (32, 32, 32, 32),
    "decoder_block_out_channels": (32, 32, 32, 32),
    "layers_per_block": (1, 1, 1, 1, 1),
}

TINY_TRANSFORMER = {
    "patch_size": 2,
    "num_attention_heads": 2,
    "attention_head_dim": 8,
    "num_layers": 2,
    "pooled_projection_dim": 16,
    "in_channels": 12,
    "qk_norm": "rms_norm",
    "text_embed_dim": 32,
    "time_embed_dim": 4,
    "activation_fn": "swiglu",
    "max_sequence_length": video.TINY_LENGTH,
}

# Mochi 1's scheduler.
TINY_SCHEDULER = {"num_train_timesteps": 1000, "shift": 1.0, "invert_sigmas": True, "use_dynamic_shifting": False}


#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "mochi-1-preview", "mochi", "MochiTransformer3DModel", {}, 10e9, 2,
        "genmo/mochi-1-preview model card: '10 billion parameter diffusion model' (AsymmDiT)",
        text={"prompt_embeds": (256, 4096), "prompt_attention_mask": (256,)}, latent_channels=12,
    ),
]
