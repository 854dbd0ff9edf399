"""``sdxl``: the tiny flavor's configs and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.families.sd.flavors import TINY_UNET as SD_UNET
from diffpipe.families.sd.flavors import TINY_VAE
from diffpipe.models.spec import Published

# -- tiny flavor ----------------------------------------
# As diffusers' own SDXL pipeline tests: two 32-wide CLIPs -> 64-wide context.
TINY_UNET = {
    **SD_UNET,
    "attention_head_dim": (2, 4),
    "use_linear_projection": True,
    "addition_embed_type": "text_time",
    "addition_time_embed_dim": 8,
    "transformer_layers_per_block": (1, 2),
    "projection_class_embeddings_input_dim": 6 * 8 + 32,  # six time ids + pooled width
    "cross_attention_dim": 64,
    "norm_num_groups": 1,
}

TINY_VAE_XL = {**TINY_VAE, "scaling_factor": 0.13025}


SDXL_UNET = {
    "sample_size": 128,
    "block_out_channels": [320, 640, 1280],
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "attention_head_dim": [5, 10, 20],
    "transformer_layers_per_block": [1, 2, 10],
    "cross_attention_dim": 2048,
    "use_linear_projection": True,
    "addition_embed_type": "text_time",
    "addition_time_embed_dim": 256,
    "projection_class_embeddings_input_dim": 2816,
}


#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "sdxl-base-1.0", "sdxl", "UNet2DConditionModel", SDXL_UNET, 2.567e9, 4,
        "SDXL report (Podell et al. 2023): 2.6B UNet; stable-diffusion-xl-base-1.0 unet 2.567B",
        text={"prompt_embeds": (77, 2048), "pooled_prompt_embeds": (1280,)},
    ),
]
