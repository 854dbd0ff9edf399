"""``cogview4``: the tiny flavor's configs and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.models import tiny
from diffpipe.models.spec import Published

# -- tiny flavor ----------------------------------------
TINY_LENGTH = 64

# Factor 8 in four levels (the pipeline reads the factor from the levels), few channels; SD-style
# scaling without shift, as the pipeline decodes.
TINY_VAE = tiny.kl_vae(levels=4, scaling_factor=1.5)

TINY_GLM = {
    "hidden_size": 32,
    "intermediate_size": 37,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
}

TINY_TRANSFORMER = {
    "patch_size": 2,
    "in_channels": 4,
    "out_channels": 4,
    "num_layers": 2,
    "attention_head_dim": 8,
    "num_attention_heads": 4,
    "text_embed_dim": 32,
    "time_embed_dim": 16,
    "condition_dim": 8,
}

# CogView4-6B's scheduler: dynamic shift mu = 0.75 sqrt(tokens / 256) + 0.25, applied linearly.
TINY_SCHEDULER = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.25,
    "max_shift": 0.75,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "time_shift_type": "linear",
}


#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "cogview4-6b", "cogview4", "CogView4Transformer2DModel",
        {"num_layers": 28, "attention_head_dim": 128, "num_attention_heads": 32}, 6e9, 1,
        "THUDM/CogView4-6B: 'CogView-4 model, which has 6B parameters' (THUDM/CogView4 README; a one-digit "
        "headline, the transformer has 6.37B)",
        text={"prompt_embeds": (512, 4096), "prompt_embeds_mask": (512,)}, latent_channels=16,
    ),
]
