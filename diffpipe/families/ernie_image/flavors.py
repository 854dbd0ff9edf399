"""``ernie-image``: the tiny flavor's configs and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.families.flux2_klein.flavors import TINY_VAE  # noqa: F401  (FLUX.2's VAE: the pipeline's)
from diffpipe.models import tiny
from diffpipe.models.spec import Published

# -- tiny flavor ----------------------------------------
TINY_LENGTH = 64

#: Mistral 3 (language model and a vision tower it does not use for captions) at tiny width.
TINY_TEXT = {**tiny.LLAMA, "model_type": "mistral", "head_dim": 8, "max_position_embeddings": 256}
TINY_VISION = {"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1,
               "num_attention_heads": 2, "head_dim": 8, "image_size": 64, "patch_size": 16}

#: Wider than the text (as 4096 over 3072), so the text projection exists; RoPE axes cover a 16-wide head.
TINY_TRANSFORMER = {"hidden_size": 48, "num_attention_heads": 3, "num_layers": 2, "ffn_hidden_size": 64,
                    "in_channels": 16, "out_channels": 16, "text_in_dim": TINY_TEXT["hidden_size"],
                    "rope_axes_dim": (4, 6, 6)}

TINY_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}

#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "ernie-image", "ernie-image", "ErnieImageTransformer2DModel",
        {"hidden_size": 4096, "num_attention_heads": 32, "num_layers": 36, "ffn_hidden_size": 12288,
         "in_channels": 128, "out_channels": 128, "text_in_dim": 3072, "rope_axes_dim": (32, 48, 48)},
        8e9, 1,
        "baidu/ERNIE-Image and ERNIE-Image-Turbo model cards: an 8B single-stream DiT (transformer config: "
        "4096 wide, 36 layers; Mistral 3 text, 3072 wide; FLUX.2's VAE)",
        text={"prompt_embeds": (512, 3072), "prompt_embeds_mask": (512,)}, latent_channels=128, vae_factor=16,
    ),
]
