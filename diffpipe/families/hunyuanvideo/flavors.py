"""``hunyuanvideo``: the tiny flavor's configs and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.models import _video as video
from diffpipe.models import tiny
from diffpipe.models.spec import Published

# -- tiny flavor ----------------------------------------
TINY_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 4,
    "down_block_types": ("HunyuanVideoDownBlock3D",) * 4,
    "up_block_types": ("HunyuanVideoUpBlock3D",) * 4,
    "block_out_channels": (8, 8, 8, 8),
    "layers_per_block": 1,
    "act_fn": "silu",
    "norm_num_groups": 4,
    "scaling_factor": 0.476986,
    "spatial_compression_ratio": 8,
    "temporal_compression_ratio": 4,
    "mid_block_add_attention": True,
}

TINY_TRANSFORMER = {
    "in_channels": 4,
    "out_channels": 4,
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "num_layers": 1,
    "num_single_layers": 1,
    "num_refiner_layers": 1,
    "patch_size": 2,
    "patch_size_t": 1,
    "guidance_embeds": True,
    "text_embed_dim": 32,
    "pooled_projection_dim": 32,
    "rope_axes_dim": (4, 6, 6),
}

# Three layers: the pipeline reads the hidden states two below the top.
TINY_LLAMA = {**tiny.LLAMA, "num_hidden_layers": 3}

TINY_SCHEDULER = {"num_train_timesteps": 1000, "shift": 7.0}

TINY_LENGTH = video.TINY_LENGTH


#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "hunyuanvideo", "hunyuanvideo", "HunyuanVideoTransformer3DModel", {}, 13e9, 2,
        "tencent/HunyuanVideo (hunyuanvideo-community/HunyuanVideo): '13 billion parameters' (2 digits; "
        "the transformer has 12.82B)",
        text={"prompt_embeds": (256, 4096), "prompt_attention_mask": (256,), "pooled_prompt_embeds": (768,)},
        latent_channels=16,
    ),
]
