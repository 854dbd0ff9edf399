"""Flavors of family ``flux-control``: the tiny flavor is ``flux``'s (its input layer is widened when
loaded for training), and the published control models' denoiser configs (sized on the meta device by
``diffpipe estimate`` and the tests)."""

from __future__ import annotations

from diffpipe.families.flux.flavors import FLUX, FLUX_TEXT
from diffpipe.models.spec import Published

#: Published models, the flagship first. BFL's full control models take 128 input channels (64 of the
#: packed latents, 64 of the packed control latents) and predict 64.
PUBLISHED: list[Published] = [
    Published(
        "flux1-depth-dev", "flux-control", "FluxTransformer2DModel",
        {**FLUX, "in_channels": 128, "out_channels": 64, "guidance_embeds": True},
        12e9, 2, "black-forest-labs/FLUX.1-Depth-dev model card: 12 billion parameter rectified flow transformer",
        text=FLUX_TEXT, latent_channels=16,
    ),
    Published(
        "flux1-canny-dev", "flux-control", "FluxTransformer2DModel",
        {**FLUX, "in_channels": 128, "out_channels": 64, "guidance_embeds": True},
        12e9, 2, "black-forest-labs/FLUX.1-Canny-dev model card: 12 billion parameter rectified flow transformer",
        text=FLUX_TEXT, latent_channels=16,
    ),
]
