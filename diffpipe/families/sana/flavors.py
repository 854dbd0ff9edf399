"""``sana``: the tiny flavor's configs and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.models import tiny
from diffpipe.models.spec import Published

# -- tiny flavor ----------------------------------------
#: A deep-compression autoencoder with two stages (2x spatial compression), 4 latent channels.
TINY_VAE = {
    "in_channels": 3,
    "latent_channels": 4,
    "attention_head_dim": 4,
    "encoder_block_types": ("ResBlock", "EfficientViTBlock"),
    "decoder_block_types": ("ResBlock", "EfficientViTBlock"),
    "encoder_block_out_channels": (16, 16),
    "decoder_block_out_channels": (16, 16),
    "encoder_layers_per_block": (1, 1),
    "decoder_layers_per_block": (1, 1),
    "encoder_qkv_multiscales": ((), (5,)),
    "decoder_qkv_multiscales": ((), (5,)),
    "downsample_block_type": "conv",
    "upsample_block_type": "interpolate",
    "scaling_factor": 0.41407,
}
TINY_TRANSFORMER = {
    "in_channels": 4,
    "out_channels": 4,
    "num_attention_heads": 2,
    "attention_head_dim": 8,
    "num_layers": 2,
    "num_cross_attention_heads": 2,
    "cross_attention_head_dim": 8,
    "cross_attention_dim": 16,
    "caption_channels": 32,
    "sample_size": 16,
    "patch_size": 1,
}
TINY_GEMMA = tiny.GEMMA
TINY_LENGTH = 32  # prompt tokens kept (after the pipeline's instruction)
# Sana's sampling scheduler: DPM-Solver on flow sigmas, shift 3 (Sana 1.6B 1024 px).
TINY_SCHEDULER = {"num_train_timesteps": 1000, "prediction_type": "flow_prediction", "use_flow_sigmas": True,
                  "flow_shift": 3.0, "algorithm_type": "dpmsolver++", "solver_order": 2}

#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "sana-1.6b-1024px", "sana", "SanaTransformer2DModel", {}, 1.6e9, 2,
        "Efficient-Large-Model/Sana_1600M_1024px_diffusers: 'Sana-1.6B' (its transformer config is the diffusers "
        "class's defaults: 20 layers, width 2240, Gemma-2-2B captions 2304 wide, 32-channel DC-AE latents)",
        text={"prompt_embeds": (300, 2304), "prompt_attention_mask": (300,)}, latent_channels=32, vae_factor=32,
    ),
]
