"""``flux2``: the tiny flavor's configs and the published model (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.families.ernie_image.flavors import TINY_TEXT as _MISTRAL3
from diffpipe.families.ernie_image.flavors import TINY_VISION  # noqa: F401  (Mistral 3's vision tower)
from diffpipe.families.flux2_klein.flavors import TINY_TRANSFORMER as _KLEIN
from diffpipe.families.flux2_klein.flavors import TINY_VAE  # noqa: F401  (FLUX.2's VAE)
from diffpipe.models.spec import Published

# -- tiny flavor ----------------------------------------
#: The tiny tokenizer spells words out character by character: the pipeline's system message alone takes
#: about 140 of its tokens, so the tiny caption length leaves room for a caption after it.
TINY_LENGTH = 256

#: The pipeline stacks Mistral 3's hidden states after layers 10, 20 and 30 (its default
#: ``text_encoder_out_layers``), so the tiny language model keeps 30 narrow layers; the real one has 40.
TINY_TEXT = {**_MISTRAL3, "num_hidden_layers": 30}

#: FLUX.2 [klein]'s tiny transformer with the guidance embedding FLUX.2 [dev] is distilled with.
TINY_TRANSFORMER = {**_KLEIN, "joint_attention_dim": 3 * TINY_TEXT["hidden_size"], "guidance_embeds": True}

#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "flux2-dev", "flux2", "Flux2Transformer2DModel",
        {"num_attention_heads": 48, "attention_head_dim": 128, "num_layers": 8, "num_single_layers": 48,
         "in_channels": 128, "joint_attention_dim": 15360, "mlp_ratio": 3.0, "guidance_embeds": True},
        32e9, 2,
        "black-forest-labs/FLUX.2-dev model card: a 32B flow-matching transformer (8 double, 48 single blocks, "
        "6144 wide; Mistral Small 3.1 24B text, hidden states of 3 layers stacked: 15360)",
        text={"prompt_embeds": (512, 15360)}, latent_channels=128, vae_factor=16,
    ),
]
