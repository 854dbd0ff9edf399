"""``hidream``: the tiny flavor's configs and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.families.flux.flavors import TINY_VAE as FLUX_VAE
from diffpipe.models import tiny
from diffpipe.models.spec import Published

# -- tiny flavor ----------------------------------------
TINY_LENGTH = 32

TINY_VAE = {**FLUX_VAE, "latent_channels": 4}

TINY_T5 = tiny.T5

TINY_LLAMA = tiny.LLAMA

TINY_TRANSFORMER = {
    "patch_size": 2, "in_channels": 4, "out_channels": 4, "num_layers": 1, "num_single_layers": 1,
    "attention_head_dim": 16, "num_attention_heads": 2, "caption_channels": [32, 32], "text_emb_dim": 64,
    "num_routed_experts": 4, "num_activated_experts": 2, "axes_dims_rope": (8, 4, 4), "max_resolution": (32, 32),
    "llama_layers": [0, 1],
}

TINY_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0}


#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "hidream-i1-full", "hidream", "HiDreamImageTransformer2DModel",
        {"patch_size": 2, "in_channels": 16, "out_channels": 16, "caption_channels": [4096, 4096],
         "axes_dims_rope": (64, 32, 32), "llama_layers": list(range(32)) + [31] * 16},
        17e9, 2, "HiDream-ai/HiDream-I1-Full model card: 17B parameters",
        text={"prompt_embeds_t5": (128, 4096), "prompt_embeds_llama3": (32, 128, 4096),
              "pooled_prompt_embeds": (2048,)}, latent_channels=16,
    ),
]
