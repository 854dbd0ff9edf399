"""Family ``kandinsky5-image``: Kandinsky 5.0 Image Lite, text-to-image on the video models' transformer.

``Kandinsky5T2IPipeline`` runs ``Kandinsky5Transformer3DModel`` (no
visual-condition channels) on one latent frame of FLUX.1's VAE, channel-last
``[B, 1, h, w, C]``, with the same Qwen2.5-VL + CLIP text encoders as the
video models but its own image-description template, and a rotary scale of
1 on every axis. So this family is ``kandinsky5``'s with those parts
swapped: the text is cached as ``kandinsky5`` caches it (each caption alone
through the pipeline's ``encode_prompt``, the template's length measured with
the folder's tokenizer), the loss runs the transformer once per prompt
length, and the pipeline-parallel layers are ``kandinsky5``'s.

Latents are the VAE's times ``scaling_factor`` with no shift: the pipeline
decodes ``latents / scaling_factor`` (FLUX.1's VAE has a ``shift_factor``,
which this pipeline does not apply). The pipeline renders only its own
resolutions (1024², 640x1408, 768x1280, 896x1152 and their transposes) and
moves any other ``sample.width``/``height`` to the nearest aspect ratio.
The editing pipeline (``Kandinsky5I2IPipeline``) is not trained here.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, Kandinsky5T2IPipeline

from diffpipe.families.kandinsky5.family import Kandinsky5Family
from diffpipe.families.kandinsky5_image.flavors import TINY_SCHEDULER, TINY_TRANSFORMER, TINY_VAE
from diffpipe.models.base import Family, Prepared
from diffpipe.models.components import Model

_BARE = Kandinsky5T2IPipeline(transformer=None, vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None,
                              tokenizer_2=None, scheduler=None)


class Kandinsky5ImageFamily(Kandinsky5Family):
    name = "kandinsky5-image"
    vae_per_frame = True
    vae_shift = False
    vae_model = Model(AutoencoderKL, TINY_VAE)
    scheduler_model = Model(FlowMatchEulerDiscreteScheduler, TINY_SCHEDULER)
    denoiser_model = Model(Kandinsky5Family.denoiser_model.cls, TINY_TRANSFORMER)
    variants: ClassVar[tuple[str, ...]] = ()
    pipeline_class = Kandinsky5T2IPipeline
    is_video = False
    template: ClassVar[str] = _BARE.prompt_template

    def __init__(self, cfg):
        Family.__init__(self, cfg)  # one kind of checkpoint: none of the video family's variants
        self.variant = None
        self.uses_control = False

    def rope_scale(self, height: int, width: int) -> tuple[float, float, float]:
        return (1.0, 1.0, 1.0)  # the pipeline's, at every size

    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32, control: torch.Tensor | None = None) -> Prepared:
        """Images ``[B, C, h, w]`` as one-frame clips (noise and mask too), then ``kandinsky5``'s inputs."""
        if latents.ndim not in (4, 5):
            raise ValueError(f"family {self.name!r} trains on [B,C,h,w] latents, got {tuple(latents.shape)}")

        def framed(x: torch.Tensor | None) -> torch.Tensor | None:
            return x if x is None or x.ndim == 5 else x[:, :, None]

        return super().prepare(framed(latents), text, generator, objective=objective, t=t, noise=framed(noise),
                               mask=framed(mask), dtype=dtype, control=control)
