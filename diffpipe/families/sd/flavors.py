"""``sd``: the tiny flavor's configs and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.models import tiny
from diffpipe.models.spec import Published

# -- tiny flavor ----------------------------------------
TINY_UNET = {
    "block_out_channels": (32, 64),
    "layers_per_block": 2,
    "sample_size": 32,
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
    "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"),
    "cross_attention_dim": 32,
}

TINY_VAE = tiny.kl_vae()

# The Stable Diffusion 1.x training schedule.
TINY_SCHEDULER = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "prediction_type": "epsilon",
    "clip_sample": False,
    "set_alpha_to_one": False,
    "steps_offset": 1,
}


SD_UNET = {"sample_size": 64, "cross_attention_dim": 768, "attention_head_dim": 8}


SD2_UNET = {
    "sample_size": 96,
    "cross_attention_dim": 1024,
    "attention_head_dim": [5, 10, 20, 20],
    "use_linear_projection": True,
}


#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "sd15", "sd", "UNet2DConditionModel", SD_UNET, 859.52e6, 5,
        "Stable Diffusion v1 model card / stable-diffusion-v1-5 unet (859.52M)",
        text={"prompt_embeds": (77, 768)},
    ),
    Published(
        "sd21", "sd", "UNet2DConditionModel", SD2_UNET, 865.91e6, 5,
        "stabilityai/stable-diffusion-2-1 unet (865.91M)",
        text={"prompt_embeds": (77, 1024)},
    ),
]
