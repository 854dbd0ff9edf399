"""``auraflow``: the tiny flavor's configs and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.families.sd.flavors import TINY_VAE as SD_TINY_VAE
from diffpipe.models import tiny
from diffpipe.models.spec import Published

# -- tiny flavor ----------------------------------------
TINY_VAE = {**SD_TINY_VAE, "scaling_factor": 0.13025}  # the SDXL VAE's factor, which AuraFlow uses
TINY_TRANSFORMER = {
    "sample_size": 16,
    "patch_size": 2,
    "in_channels": 4,
    "out_channels": 4,
    "num_mmdit_layers": 1,
    "num_single_dit_layers": 1,
    "attention_head_dim": 8,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "caption_projection_dim": 16,
    "pos_embed_max_size": 256,  # a 16x16 patch grid: the test buckets up to 64 px a side
}
TINY_UMT5 = tiny.T5
TINY_LENGTH = 32
TINY_SCHEDULER = {"num_train_timesteps": 1000, "shift": 1.73}

#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "auraflow-v0.3", "auraflow", "AuraFlowTransformer2DModel", {}, 6.8e9, 2,
        "fal/AuraFlow: '6.8B' flow-based text-to-image model (its transformer config is the diffusers class's "
        "defaults: 4 MMDiT and 32 single DiT layers, width 3072, UMT5 captions 2048 wide)",
        text={"prompt_embeds": (256, 2048)}, latent_channels=4,
    ),
]
