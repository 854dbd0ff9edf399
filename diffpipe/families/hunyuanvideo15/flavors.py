"""``hunyuanvideo15``: the tiny flavor's configs and the published model (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.families.hunyuanimage.flavors import TINY_BYT5  # noqa: F401  (the glyph encoder, ByT5)
from diffpipe.families.qwenimage.flavors import TINY_TEXT as QWEN_TEXT
from diffpipe.models.spec import Published

# -- tiny flavor ----------------------------------------
#: Prompt tokens kept after the template's first 108 (the pipeline's ``tokenizer_max_length`` is 1000): the
#: tiny tokenizer spells the pipeline's system message out by characters, so the caption follows it.
TINY_LENGTH = 640

#: The causal 3-D VAE at tiny width: 8x spatial, 4x temporal compression, 4 latent channels.
TINY_VAE = {"in_channels": 3, "out_channels": 3, "latent_channels": 4, "block_out_channels": (8, 8, 8, 8),
            "layers_per_block": 1, "spatial_compression_ratio": 8, "temporal_compression_ratio": 4,
            "scaling_factor": 1.03682}

#: Qwen2.5-VL's language model at tiny width, as Qwen-Image's (the pipeline's text encoder has no vision
#: tower); 3 layers, the pipeline reading the states two from the top.
TINY_TEXT = {**QWEN_TEXT, "num_hidden_layers": 3}

#: The transformer reads the noisy latents, the condition latents and their mask stacked (2C + 1 channels).
TINY_TRANSFORMER = {"in_channels": 2 * 4 + 1, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 16,
                    "num_layers": 2, "num_refiner_layers": 1, "text_embed_dim": TINY_TEXT["hidden_size"],
                    "text_embed_2_dim": 32, "image_embed_dim": 16, "rope_axes_dim": (4, 6, 6), "target_size": 64,
                    "task_type": "t2v"}

TINY_SCHEDULER = {"num_train_timesteps": 1000, "shift": 7.0}

#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "hunyuanvideo-1.5", "hunyuanvideo15", "HunyuanVideo15Transformer3DModel", {"task_type": "t2v"},
        8.3e9, 2,
        "tencent/HunyuanVideo-1.5 model card: 8.3B parameters (Qwen2.5-VL 7B text, 3584 wide, and a ByT5 glyph "
        "encoder; a 16x spatial, 4x temporal VAE with 32 channels)",
        text={"prompt_embeds": (1000, 3584), "prompt_embeds_mask": (1000,), "prompt_embeds_2": (256, 1472),
              "prompt_embeds_mask_2": (256,)},
        latent_channels=32, vae_factor=16,
    ),
]
