"""``ltxvideo``: the tiny flavor's configs and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.models.spec import Published

# -- tiny flavor ----------------------------------------
# Three spatio-temporal downsamplings without the 4x4 pixel patching: 8x spatial, 8x temporal.
TINY_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 8,
    "block_out_channels": (8, 8, 8, 8),
    "decoder_block_out_channels": (8, 8, 8, 8),
    "layers_per_block": (1, 1, 1, 1, 1),
    "decoder_layers_per_block": (1, 1, 1, 1, 1),
    "spatio_temporal_scaling": (True, True, True, False),
    "decoder_spatio_temporal_scaling": (True, True, True, False),
    "decoder_inject_noise": (False, False, False, False, False),
    "upsample_residual": (False, False, False, False),
    "upsample_factor": (1, 1, 1, 1),
    "timestep_conditioning": False,
    "patch_size": 1,
    "patch_size_t": 1,
    "scaling_factor": 0.8,
}

TINY_TRANSFORMER = {
    "in_channels": 8,
    "out_channels": 8,
    "patch_size": 1,
    "patch_size_t": 1,
    "num_attention_heads": 4,
    "attention_head_dim": 8,
    "cross_attention_dim": 32,
    "num_layers": 2,
    "caption_channels": 32,
}

# LTX-Video's scheduler: shift exp(mu), mu linear in the token count.
TINY_SCHEDULER = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.95,
    "max_shift": 2.05,
    "base_image_seq_len": 1024,
    "max_image_seq_len": 4096,
    "shift_terminal": 0.1,
}


#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "ltx-video-2b-v0.9", "ltxvideo", "LTXVideoTransformer3DModel", {}, 1.9e9, 2,
        "Lightricks/LTX-Video: 'a 1.9-billion-parameter' DiT (LTX-Video report, HaCohen et al. 2024; "
        "the '2B' of ltx-video-2b-v0.9)",
        text={"prompt_embeds": (128, 4096), "prompt_attention_mask": (128,)}, latent_channels=128,
        vae_factor=32,
    ),
]
