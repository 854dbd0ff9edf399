"""``qwenimage-edit``: the tiny flavor's configs and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.models.spec import Published

# -- tiny flavor ----------------------------------------
#: Caption tokens kept after the dropped head (the tiny tokenizer spells the template out
#: character by character, so its kept part holds most of the system prompt too).
TINY_LENGTH = 400

#: The tiny processor's pixel range: at most 16 vision tokens per image.
TINY_PIXELS = {"min_pixels": 56 * 56, "max_pixels": 112 * 112}


#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "qwen-image-edit", "qwenimage-edit", "QwenImageTransformer2DModel", {}, 20e9, 2,
        "Qwen/Qwen-Image-Edit model card: the 20B Qwen-Image MMDiT, same transformer config",
        # 512 caption tokens + up to 1456 vision tokens of the ~1024² control image.
        text={"prompt_embeds": (1968, 3584), "prompt_embeds_mask": (1968,)}, latent_channels=16,
    ),
]
