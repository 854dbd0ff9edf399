"""``skyreels-v2``: the tiny flavor (Wan's tiny parts) and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.families.wan.flavors import WAN_14B, WAN_14B_I2V
from diffpipe.models.spec import Published, published_series

_skyreels = published_series("skyreels-v2", "SkyReelsV2Transformer3DModel", text={"prompt_embeds": (512, 4096)},
                             latent_channels=16)

#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    _skyreels("skyreels-v2-t2v-14b", WAN_14B, 14e9, 2,
              "Skywork/SkyReels-V2-T2V-14B-540P(-Diffusers) and -720P model cards: 14B (Wan 2.1 14B's architecture: "
              "dim 5120, 40 layers)", variant="t2v"),
    _skyreels("skyreels-v2-i2v-14b", WAN_14B_I2V, 16.39e9, 4,
              "Skywork/SkyReels-V2-I2V-14B-540P(-Diffusers) and -720P model cards: 14B (Wan 2.1 I2V 14B's "
              "architecture: 36 input channels, a 1280-dim CLIP image embedder and image key/value projections in "
              "every block, about 2.1B beyond the T2V transformer)", variant="i2v"),
    _skyreels("skyreels-v2-df-14b", WAN_14B, 14e9, 2,
              "Skywork/SkyReels-V2-DF-14B-540P(-Diffusers) and -720P model cards: 14B diffusion forcing (the T2V 14B "
              "transformer config, without a frame-rate embedding: diffusers' conversion script)", variant="df"),
    _skyreels("skyreels-v2-df-1.3b", {"num_attention_heads": 12, "attention_head_dim": 128, "ffn_dim": 8960,
                                      "num_layers": 30, "inject_sample_info": True},
              1.44e9, 3,
              "Skywork/SkyReels-V2-DF-1.3B-540P(-Diffusers): Wan 2.1 1.3B's architecture (dim 1536, 30 layers) plus a "
              "frame-rate embedding (inject_sample_info, diffusers' conversion script): 1.44B in its weights "
              "(headline '1.3B')", variant="df"),
]
