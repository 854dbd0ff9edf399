"""``zimage``: the tiny flavor's configs and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.models import tiny
from diffpipe.models.spec import Published

# -- tiny flavor ----------------------------------------
TINY_LENGTH = 128  # the tiny tokenizer spells the chat template's words out character by character

# FLUX.1's VAE at tiny width: factor 8 in four levels, its scaling and shift.
TINY_VAE = tiny.kl_vae(levels=4, quant_conv=False, scaling_factor=0.3611, shift_factor=0.1159)

#: A Qwen3-style decoder (Z-Image's text encoder is Qwen3-4B): the Llama shape with an explicit head width.
TINY_QWEN3 = {**tiny.LLAMA, "head_dim": 8}

TINY_TRANSFORMER = {
    "in_channels": 4,
    "dim": 32,
    "n_layers": 2,
    "n_refiner_layers": 1,
    "n_heads": 2,
    "n_kv_heads": 2,
    "cap_feat_dim": 32,
    "axes_dims": [4, 6, 6],
    "axes_lens": [1024, 64, 64],
}

# Z-Image-Turbo's scheduler: a fixed shift of 3.
TINY_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}


#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "z-image-turbo", "zimage", "ZImageTransformer2DModel", {}, 6e9, 1,
        "Tongyi-MAI/Z-Image-Turbo model card: 6B single-stream DiT (Qwen3-4B text, 2560 wide)",
        text={"prompt_embeds": (512, 2560), "prompt_embeds_mask": (512,)}, latent_channels=16,
    ),
]
