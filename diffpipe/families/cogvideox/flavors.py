"""``cogvideox``: the tiny flavor's configs and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.models import _video as video
from diffpipe.models.spec import Published

# -- tiny flavor ----------------------------------------
TINY_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ("CogVideoXDownBlock3D",) * 4,
    "up_block_types": ("CogVideoXUpBlock3D",) * 4,
    "block_out_channels": (8, 8, 8, 8),
    "latent_channels": 4,
    "layers_per_block": 1,
    "norm_num_groups": 2,
    "temporal_compression_ratio": 4,
}

# CogVideoX-5b-style (rotary positions); sample sizes are the latent grid of 48x32 px clips.
TINY_TRANSFORMER = {
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "in_channels": 4,
    "out_channels": 4,
    "time_embed_dim": 16,
    "text_embed_dim": 32,
    "num_layers": 2,
    "sample_width": 6,
    "sample_height": 4,
    "sample_frames": 9,
    "patch_size": 2,
    "temporal_compression_ratio": 4,
    "max_text_seq_length": video.TINY_LENGTH,
    "use_rotary_positional_embeddings": True,
}

# CogVideoX-2b's scheduler (v-prediction, SNR shift 3, zero terminal SNR).
TINY_SCHEDULER = {
    "_class_name": "CogVideoXDDIMScheduler",
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "clip_sample": False,
    "prediction_type": "v_prediction",
    "rescale_betas_zero_snr": True,
    "set_alpha_to_one": True,
    "snr_shift_scale": 3.0,
    "steps_offset": 0,
    "timestep_spacing": "trailing",
}


#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "cogvideox-2b", "cogvideox", "CogVideoXTransformer3DModel", {}, 2e9, 1,
        "THUDM/CogVideoX-2b model card: 'CogVideoX-2B' (a one-digit headline; the transformer has 1.69B)",
        text={"prompt_embeds": (226, 4096)}, latent_channels=16,
    ),
]
