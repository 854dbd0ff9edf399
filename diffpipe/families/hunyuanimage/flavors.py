"""``hunyuanimage``: the tiny flavor's configs and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.models.spec import Published

# -- tiny flavor ----------------------------------------
TINY_VAE = {"in_channels": 3, "out_channels": 3, "latent_channels": 4, "block_out_channels": (32, 32, 32),
            "layers_per_block": 1, "spatial_compression_ratio": 4, "sample_size": 64, "scaling_factor": 0.75}

TINY_BYT5 = {"d_model": 32, "d_kv": 8, "d_ff": 37, "num_layers": 1, "num_heads": 4, "relative_attention_num_buckets": 8}

TINY_TRANSFORMER = {"in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 16,
                    "num_layers": 1, "num_single_layers": 1, "num_refiner_layers": 1, "patch_size": (1, 1),
                    "text_embed_dim": 32, "text_embed_2_dim": 32, "rope_axes_dim": (8, 8)}

TINY_SCHEDULER = {"num_train_timesteps": 1000, "shift": 5.0}


#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "hunyuanimage-2.1", "hunyuanimage", "HunyuanImageTransformer2DModel", {"text_embed_2_dim": 1472},
        17e9, 2, "tencent/HunyuanImage-2.1 model card: 17B parameters",
        # The pipeline's lengths: 1000 Qwen2.5-VL tokens (3584 wide), 128 glyph tokens (ByT5, 1472 wide).
        text={"prompt_embeds": (1000, 3584), "prompt_embeds_mask": (1000,), "prompt_embeds_2": (128, 1472),
              "prompt_embeds_mask_2": (128,)},
        latent_channels=64, vae_factor=32,
    ),
]
