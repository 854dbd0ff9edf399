"""``cosmos2``: the tiny flavor's configs and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.models import tiny
from diffpipe.models.spec import Published, published_series

# -- tiny flavor ----------------------------------------
TINY_LENGTH = 32

TINY_VAE = tiny.WAN_VAE

TINY_T5 = tiny.T5

# Cosmos-Predict2's layout (rope scale, no learnable position embedding), tiny widths. One
# difference: the published models concatenate the padding mask (``concat_padding_mask``), which
# diffusers resizes with torchvision; torchvision has no build for this CPU torch here, so the
# tiny model leaves it out (the pipeline still passes the mask; the transformer ignores it).
TINY_TRANSFORMER = {
    "in_channels": 16,
    "out_channels": 16,
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "num_layers": 2,
    "mlp_ratio": 2.0,
    "text_embed_dim": 32,
    "adaln_lora_dim": 4,
    "max_size": (4, 32, 32),
    "patch_size": (1, 2, 2),
    "rope_scale": (1.0, 4.0, 4.0),
    "concat_padding_mask": False,
    "extra_pos_embed_type": None,
}

TINY_SCHEDULER = {"num_train_timesteps": 1000, "shift": 1.0, "use_karras_sigmas": True}


_cosmos = published_series("cosmos2", "CosmosTransformer3DModel", text={"prompt_embeds": (512, 1024)},
                           latent_channels=16)
#: Cosmos-Predict2's text-to-image layout: rope scaled in space only, no learnable position embedding.
_T2I = {"rope_scale": (1.0, 4.0, 4.0), "extra_pos_embed_type": None}

#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    _cosmos("cosmos-predict2-2b-t2i", {**_T2I, "num_attention_heads": 16, "num_layers": 28}, 2e9, 1,
            "nvidia/Cosmos-Predict2-2B-Text2Image: 'text to image generation (2 billion parameters)' (Cosmos "
            "Predict2 model matrix; a one-digit headline, the transformer has 1.96B)"),
    _cosmos("cosmos-predict2-14b-t2i", {**_T2I, "num_attention_heads": 40, "num_layers": 36}, 14e9, 2,
            "nvidia/Cosmos-Predict2-14B-Text2Image: 'text to image generation (14 billion parameters)' (Cosmos "
            "Predict2 model matrix; the transformer has 14.27B)"),
]
