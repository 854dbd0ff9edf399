"""``skyreels-v2``: the tiny flavor (Wan's tiny parts) and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.models.spec import Published

_WAN_14B = {"num_attention_heads": 40, "attention_head_dim": 128, "ffn_dim": 13824, "num_layers": 40}

#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "skyreels-v2-t2v-14b", "skyreels-v2", "SkyReelsV2Transformer3DModel", _WAN_14B, 14e9, 2,
        "Skywork/SkyReels-V2-T2V-14B-540P(-Diffusers) and -720P model cards: 14B (Wan 2.1 14B's architecture: "
        "dim 5120, 40 layers)",
        text={"prompt_embeds": (512, 4096)}, latent_channels=16, variant="t2v",
    ),
    Published(
        "skyreels-v2-i2v-14b", "skyreels-v2", "SkyReelsV2Transformer3DModel",
        {**_WAN_14B, "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120},
        16.39e9, 4,
        "Skywork/SkyReels-V2-I2V-14B-540P(-Diffusers) and -720P model cards: 14B (Wan 2.1 I2V 14B's architecture: "
        "36 input channels, a 1280-dim CLIP image embedder and image key/value projections in every block, "
        "about 2.1B beyond the T2V transformer)",
        text={"prompt_embeds": (512, 4096)}, latent_channels=16, variant="i2v",
    ),
    Published(
        "skyreels-v2-df-14b", "skyreels-v2", "SkyReelsV2Transformer3DModel", _WAN_14B, 14e9, 2,
        "Skywork/SkyReels-V2-DF-14B-540P(-Diffusers) and -720P model cards: 14B diffusion forcing (the T2V 14B "
        "transformer config, without a frame-rate embedding: diffusers' conversion script)",
        text={"prompt_embeds": (512, 4096)}, latent_channels=16, variant="df",
    ),
    Published(
        "skyreels-v2-df-1.3b", "skyreels-v2", "SkyReelsV2Transformer3DModel",
        {"num_attention_heads": 12, "attention_head_dim": 128, "ffn_dim": 8960, "num_layers": 30,
         "inject_sample_info": True},
        1.44e9, 3,
        "Skywork/SkyReels-V2-DF-1.3B-540P(-Diffusers): Wan 2.1 1.3B's architecture (dim 1536, 30 layers) plus a "
        "frame-rate embedding (inject_sample_info, diffusers' conversion script): 1.44B in its weights "
        "(headline '1.3B')",
        text={"prompt_embeds": (512, 4096)}, latent_channels=16, variant="df",
    ),
]
