"""``flux-kontext``: the tiny flavor's configs and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.families.flux.flavors import FLUX, FLUX_TEXT
from diffpipe.models.spec import Published

#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "flux1-kontext-dev", "flux-kontext", "FluxTransformer2DModel", {**FLUX, "guidance_embeds": True},
        12e9, 2, "black-forest-labs/FLUX.1-Kontext-dev model card: 12 billion parameter",
        text=FLUX_TEXT, latent_channels=16,
    ),
]
