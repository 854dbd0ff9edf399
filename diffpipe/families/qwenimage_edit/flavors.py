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
    *[
        Published(
            f"qwen-image-edit-{v}", "qwenimage-edit", "QwenImageTransformer2DModel", config, 20e9, 2,
            f"Qwen/Qwen-Image-Edit-{v} model card: Qwen-Image-Edit-Plus, the 20B Qwen-Image MMDiT"
            + (" with zero_cond_t" if config else ""),
            # 512 caption tokens + 4 references of at most 235 vision tokens (~384²) and about 7 more each.
            text={"prompt_embeds": (1480, 3584), "prompt_embeds_mask": (1480,)}, latent_channels=16, variant=v,
        )
        for v, config in (("2509", {}), ("2511", {"zero_cond_t": True}))
    ],
]
