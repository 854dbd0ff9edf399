"""``kandinsky5``: the tiny flavor's configs and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.families.hunyuanvideo.flavors import TINY_VAE  # noqa: F401  (HunyuanVideo's VAE: the pipeline's)
from diffpipe.families.qwenimage.flavors import TINY_TEXT, TINY_VISION  # noqa: F401  (a tiny Qwen2.5-VL)
from diffpipe.models.spec import Published, published_series

# -- tiny flavor ----------------------------------------
#: Caption tokens kept after the template (the pipeline's ``max_sequence_length``; tiny: fewer).
TINY_LENGTH = 64

#: Kandinsky 5 T2V Lite at tiny width: 2 text and 2 visual blocks, visual conditioning channels (as the
#: published T2V models: the pipeline feeds zeros and a zero mask beside the noisy latents).
TINY_TRANSFORMER = {
    "in_visual_dim": 4,
    "out_visual_dim": 4,
    "in_text_dim": TINY_TEXT["hidden_size"],
    "in_text_dim2": 32,
    "time_dim": 16,
    "patch_size": (1, 2, 2),
    "model_dim": 32,
    "ff_dim": 48,
    "num_text_blocks": 1,
    "num_visual_blocks": 2,
    "axes_dims": (8, 4, 4),
    "visual_cond": True,
}

#: The T2V Lite scheduler (flow matching, shift 5).
TINY_SCHEDULER = {"num_train_timesteps": 1000, "shift": 5.0}

_kandinsky = published_series(
    "kandinsky5", "Kandinsky5Transformer3DModel", latent_channels=16,
    text={"prompt_embeds": (512, 3584), "prompt_embeds_mask": (512,), "pooled_prompt_embeds": (768,)})
#: What every published Kandinsky 5 video transformer shares: 16 latent channels, Qwen2.5-VL and CLIP-L text.
_VIDEO = {"in_visual_dim": 16, "out_visual_dim": 16, "in_text_dim": 3584, "in_text_dim2": 768, "visual_cond": True}

#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    _kandinsky("kandinsky-5-t2v-lite", {**_VIDEO, "time_dim": 512, "model_dim": 1792, "ff_dim": 7168,
                                        "num_text_blocks": 2, "num_visual_blocks": 32, "axes_dims": (16, 24, 24)},
               2e9, 1,
               "kandinskylab/Kandinsky-5.0-T2V-Lite (Diffusers) model card and transformer config: a 2B video DiT "
               "(width 1792, 2 text and 32 visual blocks), Qwen2.5-VL 7B and CLIP ViT-L text, HunyuanVideo's VAE"),
    _kandinsky("kandinsky-5-video-pro", {**_VIDEO, "time_dim": 1024, "model_dim": 4096, "ff_dim": 16384,
                                         "num_text_blocks": 4, "num_visual_blocks": 60, "axes_dims": (32, 48, 48)},
               19e9, 2,
               "kandinskylab/Kandinsky-5.0-T2V-Pro and I2V-Pro (Diffusers) transformer config (width 4096, 4 text "
               "and 60 visual blocks, time embedding 1024; the same for both tasks): 19.31B counted, headline '19B'"),
]
