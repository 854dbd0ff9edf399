"""``qwenimage``: the tiny flavor's configs and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.models.spec import Published

# -- tiny flavor ----------------------------------------
TINY_LENGTH = 160  # the tiny tokenizer spells the template out character by character

TINY_VAE = {"base_dim": 24, "z_dim": 4, "dim_mult": [1, 2, 4], "num_res_blocks": 1,
            "temperal_downsample": [False, True], "latents_mean": [0.1, -0.2, 0.0, 0.3],
            "latents_std": [1.5, 0.8, 1.0, 2.0]}

TINY_TEXT = {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2,
             "rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1000000.0}}

TINY_VISION = {"depth": 1, "hidden_size": 16, "out_hidden_size": 32, "num_heads": 2, "intermediate_size": 32,
               "fullatt_block_indexes": [0]}

TINY_TRANSFORMER = {"patch_size": 2, "in_channels": 16, "out_channels": 4, "num_layers": 2,
                    "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 32,
                    "axes_dims_rope": (4, 6, 6)}

# Qwen-Image's scheduler (its ``shift_terminal`` only stretches inference sigmas).
TINY_SCHEDULER = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5,
                  "max_shift": 0.9, "base_image_seq_len": 256, "max_image_seq_len": 8192,
                  "shift_terminal": 0.02, "time_shift_type": "exponential"}


#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "qwen-image", "qwenimage", "QwenImageTransformer2DModel", {}, 20e9, 2,
        "Qwen/Qwen-Image model card: 20B MMDiT",
        text={"prompt_embeds": (512, 3584), "prompt_embeds_mask": (512,)}, latent_channels=16,
    ),
]
