"""``chroma``: the tiny flavor's configs and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.families.flux.flavors import FLUX
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
    "axes_dims_rope": (4, 4, 8),
    "approximator_num_channels": 8,
    "approximator_hidden_dim": 32,
    "approximator_layers": 1,
}


#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "chroma1-hd", "chroma", "ChromaTransformer2DModel", FLUX, 8.9e9, 2,
        "lodestones/Chroma1-HD model card: 8.9B parameters",
        text={"prompt_embeds": (512, 4096), "prompt_attention_mask": (512,)}, latent_channels=16,
    ),
]
