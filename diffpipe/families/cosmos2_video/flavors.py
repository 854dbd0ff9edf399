"""``cosmos2-video``: the tiny flavor's configs and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.families.cosmos2.flavors import TINY_TRANSFORMER
from diffpipe.models.spec import Published

# -- tiny flavor ----------------------------------------
# Video2World's layout (17 input channels, Predict2-2B Video2World's rope scale), tiny widths;
# like ``cosmos2``'s tiny model it leaves out the padding-mask channel (torchvision).
TINY_TRANSFORMER_V2W = {**TINY_TRANSFORMER, "in_channels": 17, "max_size": (16, 32, 32), "rope_scale": (1.0, 3.0, 3.0)}


#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "cosmos-predict2-2b-video2world", "cosmos2-video", "CosmosTransformer3DModel",
        {"in_channels": 17, "num_attention_heads": 16, "num_layers": 28, "rope_scale": (1.0, 3.0, 3.0),
         "extra_pos_embed_type": None},
        2e9, 1,
        "nvidia/Cosmos-Predict2-2B-Video2World ('Video + Text based future visual world generation', Cosmos-"
        "Predict2 README; the 2B of its name, one digit; 16 latent + 1 condition-mask input channels, 1.96B)",
        text={"prompt_embeds": (512, 1024)}, latent_channels=16,
    ),
    Published(
        "cosmos-predict2-14b-video2world", "cosmos2-video", "CosmosTransformer3DModel",
        {"in_channels": 17, "num_attention_heads": 40, "num_layers": 36, "rope_scale": (20 / 24, 2.0, 2.0),
         "extra_pos_embed_type": None},
        14e9, 2,
        "nvidia/Cosmos-Predict2-14B-Video2World ('Video + Text based future visual world generation', Cosmos-"
        "Predict2 README; the 14B of its name; the transformer has 14.27B)",
        text={"prompt_embeds": (512, 1024)}, latent_channels=16,
    ),
]
