"""``kandinsky5-image``: the tiny flavor's configs and the published model (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.families.kandinsky5.flavors import TINY_TRANSFORMER as VIDEO_TRANSFORMER
from diffpipe.models import tiny
from diffpipe.models.spec import Published

# -- tiny flavor ----------------------------------------
#: A FLUX-style KL VAE (no quant convolutions, scaling and shift factors), 4 latent channels, factor 8.
TINY_VAE = tiny.kl_vae(levels=4, latent_channels=4, quant_conv=False, scaling_factor=0.3611, shift_factor=0.1159)

#: The video models' tiny transformer without visual-condition channels (Image Lite has none).
TINY_TRANSFORMER = {**VIDEO_TRANSFORMER, "visual_cond": False}

#: The editing checkpoints' transformer: visual-condition channels (the image's latents and a mask).
TINY_EDIT_TRANSFORMER = {**VIDEO_TRANSFORMER, "visual_cond": True}

#: A flow-matching scheduler with no shift (the tiny flavor's; a folder's own is read from it).
TINY_SCHEDULER = {"num_train_timesteps": 1000, "shift": 1.0}

_IMAGE_LITE = {"in_visual_dim": 16, "out_visual_dim": 16, "in_text_dim": 3584, "in_text_dim2": 768, "time_dim": 512,
               "model_dim": 2560, "ff_dim": 10240, "num_text_blocks": 2, "num_visual_blocks": 50,
               "axes_dims": (32, 48, 48)}

#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "kandinsky-5-image-lite", "kandinsky5-image", "Kandinsky5Transformer3DModel",
        _IMAGE_LITE,
        6e9, 1,
        "Kandinsky 5.0 Image Lite (kandinskylab/Kandinsky-5.0-T2I-Lite): the repository's T2I config (width 2560, "
        "2 text and 50 visual blocks, no visual conditioning; FLUX.1's VAE): 6.02B counted, headline '6B'",
        text={"prompt_embeds": (512, 3584), "prompt_embeds_mask": (512,), "pooled_prompt_embeds": (768,)},
        latent_channels=16, variant="t2i",
    ),
    Published(
        "kandinsky-5-image-lite-edit", "kandinsky5-image", "Kandinsky5Transformer3DModel",
        {**_IMAGE_LITE, "visual_cond": True},
        6e9, 1,
        "Kandinsky 5.0 Image Lite editing (kandinskylab/Kandinsky-5.0-I2I-Lite-sft-Diffusers, the editing "
        "pipeline's example): Image Lite's transformer with visual-condition channels (the pipeline concatenates "
        "the image's latents and a mask): 6.02B counted, headline '6B'",
        text={"prompt_embeds": (512, 3584), "prompt_embeds_mask": (512,), "pooled_prompt_embeds": (768,)},
        latent_channels=16, variant="i2i",
    ),
]
