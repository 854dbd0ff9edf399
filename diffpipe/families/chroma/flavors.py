"""``chroma``: the tiny flavor's configs and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.families.flux.flavors import FLUX
from diffpipe.families.flux.flavors import TINY_TRANSFORMER as FLUX_TINY
from diffpipe.models.spec import Published

# -- tiny flavor ----------------------------------------
# FLUX.1's tiny transformer without the pooled-text and guidance inputs, plus Chroma's modulation approximator.
TINY_TRANSFORMER = {k: v for k, v in FLUX_TINY.items() if k not in ("pooled_projection_dim", "guidance_embeds")} | {
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
