"""``flux``: the tiny flavor's configs and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.models import tiny
from diffpipe.models.spec import Published

# -- tiny flavor ----------------------------------------
TINY_TRANSFORMER = {
    "patch_size": 1,
    "in_channels": 4,
    "num_layers": 1,
    "num_single_layers": 1,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 32,
    "axes_dims_rope": (4, 4, 8),
    # Like FLUX.1-dev (guidance-distilled), so the guidance path is exercised.
    "guidance_embeds": True,
}

# One latent channel: 2x2 packing turns it into the transformer's 4 channels.
# Scaling and shift factors are FLUX.1's, so normalisation is not the identity.
TINY_VAE = tiny.kl_vae(latent_channels=1, quant_conv=False, scaling_factor=0.3611, shift_factor=0.1159)

TINY_T5 = tiny.T5

TINY_T5_LENGTH = 32

# FLUX.1-dev's scheduler: resolution-dependent shift.
TINY_SCHEDULER = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}


FLUX = {"in_channels": 64, "num_layers": 19, "num_single_layers": 38, "axes_dims_rope": [16, 56, 56]}


FLUX_TEXT = {"prompt_embeds": (512, 4096), "pooled_prompt_embeds": (768,)}


#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "flux1-dev", "flux", "FluxTransformer2DModel", {**FLUX, "guidance_embeds": True},
        11.90e9, 4, "black-forest-labs/FLUX.1-dev transformer (11.90B; '12 billion parameter')",
        text=FLUX_TEXT, latent_channels=16,
    ),
    Published(
        "flux1-schnell", "flux", "FluxTransformer2DModel", {**FLUX, "guidance_embeds": False},
        12e9, 2, "black-forest-labs/FLUX.1-schnell model card: 12 billion parameter",
        text=FLUX_TEXT, latent_channels=16,
    ),
]
