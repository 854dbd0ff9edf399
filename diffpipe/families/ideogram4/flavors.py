"""``ideogram4``: the tiny flavor's configs and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.families.flux2_klein.flavors import TINY_VAE  # noqa: F401  (FLUX.2's VAE: the pipeline's)
from diffpipe.families.krea2.flavors import TINY_TEXT, TINY_VISION  # noqa: F401  (a tiny Qwen3-VL, 36 layers)
from diffpipe.models.spec import Published

# -- tiny flavor ----------------------------------------
TINY_LENGTH = 256  # the tiny tokenizer spells the chat template's words out character by character

#: The pipeline concatenates the hidden states of 13 text-encoder layers per token.
TEXT_LAYERS = 13

#: Head width 16: 8 rotary frequencies, of which the interleaved (t, h, w) sections take every third.
TINY_TRANSFORMER = {"in_channels": 16, "num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
                    "intermediate_size": 32, "adaln_dim": 16, "llm_features_dim": TEXT_LAYERS * TINY_TEXT["hidden_size"],
                    "mrope_section": (2, 2, 2)}

#: The pipeline sets its own (logit-normal) sigmas; the scheduler only steps them.
TINY_SCHEDULER = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False}

#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "ideogram-4", "ideogram4", "Ideogram4Transformer2DModel", {}, 9.28e9, 3,
        "fal/ideogram-v4-instant model card (a distillation of ideogram-ai/ideogram-4-fp8 with the same "
        "transformer): about 9.28 billion parameters; the class defaults of diffusers' "
        "Ideogram4Transformer2DModel: 34 blocks at width 4608, Qwen3-VL-8B text tapped at 13 layers (53248)",
        text={"prompt_embeds": (512, 53248), "prompt_embeds_mask": (512,)}, latent_channels=128, vae_factor=16,
    ),
]
