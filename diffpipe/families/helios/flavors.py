"""``helios``: the tiny flavor (Wan's tiny parts) and the published model (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.families.wan.flavors import TINY_TRANSFORMER as WAN_TRANSFORMER
from diffpipe.models.spec import Published

# -- tiny flavor ----------------------------------------
#: Wan's tiny transformer with Helios' history patch embeddings; the rotary axes cover its 12-wide heads.
TINY_TRANSFORMER = {**{k: v for k, v in WAN_TRANSFORMER.items() if k != "rope_max_seq_len"}, "rope_dim": (4, 4, 4)}

#: Helios-Base's sampling: one stage, UniPC on flow sigmas shifted by the resolution-dependent ``mu``.
TINY_SCHEDULER = {"_class_name": "HeliosScheduler", "num_train_timesteps": 1000, "shift": 1.0, "stages": 1,
                  "use_dynamic_shifting": True, "scheduler_type": "unipc"}

#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "helios-14b", "helios", "HeliosTransformer3DModel", {}, 14e9, 2,
        "BestWishYsh/Helios-Base (PKU-YuanGroup/Helios): 'a 14B real-time long-video generation model' "
        "(Wan 2.1 14B's width and depth, the class defaults of diffusers' HeliosTransformer3DModel: 14.31B "
        "counted with its history patch embeddings)",
        text={"prompt_embeds": (512, 4096)}, latent_channels=16,
    ),
]
