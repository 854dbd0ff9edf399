"""``lumina2``: the tiny flavor's configs and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.models import tiny
from diffpipe.models.spec import Published

# -- tiny flavor ----------------------------------------
TINY_LENGTH = 64

# Factor 8 in four levels, few channels.
TINY_VAE8 = tiny.kl_vae(levels=4, quant_conv=False, scaling_factor=0.3611, shift_factor=0.1159)

TINY_GEMMA = tiny.GEMMA

TINY_TRANSFORMER = {
    "sample_size": 8,
    "patch_size": 2,
    "in_channels": 4,
    "hidden_size": 32,
    "num_layers": 2,
    "num_refiner_layers": 1,
    "num_attention_heads": 2,
    "num_kv_heads": 1,
    "multiple_of": 16,
    "axes_dim_rope": (4, 6, 6),
    "axes_lens": (300, 64, 64),
    "cap_feat_dim": 32,
}

# Lumina-Image-2.0's scheduler: a fixed shift of 6.
TINY_SCHEDULER = {"num_train_timesteps": 1000, "shift": 6.0}


#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "lumina-image-2.0", "lumina2", "Lumina2Transformer2DModel", {"cap_feat_dim": 2304}, 2.6e9, 2,
        "Alpha-VLLM/Lumina-Image-2.0 model card: 2.6B parameters (Gemma-2-2B text, 2304 wide)",
        text={"prompt_embeds": (256, 2304), "prompt_attention_mask": (256,)}, latent_channels=16,
    ),
]
