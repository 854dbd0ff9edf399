"""``krea2``: the tiny flavor's configs and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.families.qwenimage.flavors import TINY_VAE  # noqa: F401  (the Qwen-Image VAE: the pipeline's)
from diffpipe.models.spec import Published

# -- tiny flavor ----------------------------------------
#: Caption tokens after the template's system prefix (the tiny tokenizer spells the prefix out character by
#: character, so the pipeline's 34-token cut leaves part of it: the layout is the pipeline's either way).
TINY_LENGTH = 256

#: A Qwen3-VL language model at tiny width; 36 layers, as the pipeline taps 12 of them up to layer 35.
TINY_TEXT = {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 36, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 1024,
             "rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True}}
TINY_VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 32,
               "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "deepstack_visual_indexes": [0],
               "num_position_embeddings": 16}

TINY_TRANSFORMER = {"in_channels": 16, "num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
                    "num_key_value_heads": 1, "intermediate_size": 32, "timestep_embed_dim": 32,
                    "text_hidden_dim": TINY_TEXT["hidden_size"], "num_text_layers": 12, "text_num_attention_heads": 2,
                    "text_num_key_value_heads": 2, "text_intermediate_size": 32, "num_layerwise_text_blocks": 1,
                    "num_refiner_text_blocks": 1, "axes_dims_rope": (4, 6, 6)}

#: Krea 2 Base's sampling: flow matching with the resolution-dependent shift.
TINY_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5,
                  "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 6400}

#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "krea-2", "krea2", "Krea2Transformer2DModel", {}, 12.9e9, 3,
        "Krea 2 Base / Turbo (Diffusers) model cards: single-stream DiT, 12.9B parameters, 28 blocks at width "
        "6144, Qwen3-VL-4B text tapped at 12 layers (the class defaults of diffusers' Krea2Transformer2DModel)",
        text={"prompt_embeds": (512, 12, 2560), "prompt_embeds_mask": (512,)}, latent_channels=16,
    ),
]
