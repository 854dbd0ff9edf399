"""Family ``kandinsky5-image``: Kandinsky 5.0 Image Lite, text-to-image and image editing, on the video
models' transformer.

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

``model.variant: i2i`` trains the editing checkpoints (``Kandinsky5I2IPipeline``; a local folder saved with
that pipeline is detected). Each item's control image is the image to edit: its latents (the VAE's mean
times ``scaling_factor``, where the pipeline draws a sample) fill the transformer's visual-condition
channels beside the noisy latents, with a mask of ones, as the pipeline's ``prepare_latents`` builds them;
and the Qwen2.5-VL text encoder sees it too, at half its size after the caption in the editing template,
through the vision-language processor the pipeline keeps in its ``tokenizer`` slot (the cache hands each
caption its whole control image, as sampling hands the pipeline the user's image).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, ClassVar

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, Kandinsky5I2IPipeline, Kandinsky5T2IPipeline
from PIL import Image
from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from diffpipe.families.kandinsky5.family import Kandinsky5Family, folder_variant, template_start
from diffpipe.families.kandinsky5.flavors import TINY_LENGTH
from diffpipe.families.kandinsky5_image import flavors
from diffpipe.families.qwenimage_edit.family import _load_processor, tiny_processor, tiny_vl_text_encoder
from diffpipe.models.base import Family, Prepared
from diffpipe.models.components import Model, Models, TextBundle, TextEncoder, Tokenizer, clip_text_encoder

#: The image's place in the editing template.
VISION_SLOT = "<|vision_start|><|image_pad|><|vision_end|>"

_BARE = Kandinsky5T2IPipeline(transformer=None, vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None,
                              tokenizer_2=None, scheduler=None)
_BARE_EDIT = Kandinsky5I2IPipeline(transformer=None, vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None,
                                   tokenizer_2=None, scheduler=None)


class EditProcessor:
    """The editing pipeline's ``tokenizer``: a folder's vision-language processor (its ``tokenizer/``
    subfolder holds the tokenizer and the image processor's settings)."""

    @staticmethod
    def from_pretrained(path: str, subfolder: str = "tokenizer") -> Any:
        return _load_processor(path, AutoTokenizer.from_pretrained(path, subfolder=subfolder), subfolder)


#: The editing variant's text parts: the processor in the ``tokenizer`` slot, a Qwen2.5-VL that reads
#: images, CLIP as in text-to-image.
EDIT_TEXT_PARTS = {
    # The tiny tokenizer's limit is the tiny prompt length, as text-to-image's (a folder's caps it likewise).
    "tokenizer": Tokenizer(EditProcessor, lambda: tiny_processor(TINY_LENGTH)),
    "text_encoder": TextEncoder(
        Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLConfig,
        lambda proc, seed: tiny_vl_text_encoder(proc.tokenizer, seed, "kandinsky5-image.text_encoder")),
    **clip_text_encoder("kandinsky5.text_encoder_2"),
}


class Kandinsky5ImageFamily(Kandinsky5Family):
    vae_per_frame = True
    vae_shift = False
    models = Models(AutoencoderKL, None, FlowMatchEulerDiscreteScheduler, Kandinsky5T2IPipeline, flavors)
    denoiser_model = Model(Kandinsky5Family.denoiser_model.cls, flavors.TINY_TRANSFORMER)
    #: ``t2i`` (text-to-image) and ``i2i`` (the editing checkpoints); a local folder's is read from its
    #: pipeline class.
    variants: ClassVar[tuple[str, ...]] = ("t2i", "i2i")
    is_video = False
    template: ClassVar[str] = _BARE.prompt_template

    def __init__(self, cfg):
        Family.__init__(self, cfg)  # not the video family's variants
        self.variant = folder_variant(cfg, {Kandinsky5I2IPipeline.__name__: "i2i"}, "t2i", "Kandinsky 5.0 Image Lite")
        #: The editing checkpoints train on control images, which their text encoder sees too.
        self.uses_control = self.text_uses_control = self.variant == "i2i"
        if self.uses_control:
            self.pipeline_class = Kandinsky5I2IPipeline
            self.template = _BARE_EDIT.prompt_template
            self.denoiser_model = Model(Kandinsky5Family.denoiser_model.cls, flavors.TINY_EDIT_TRANSFORMER)
            self.text_parts = EDIT_TEXT_PARTS

    def rope_scale(self, height: int, width: int) -> tuple[float, float, float]:
        return (1.0, 1.0, 1.0)  # the pipeline's, at every size

    def text_settings(self) -> dict[str, Any]:
        return {**super().text_settings(), **({"template": self.template} if self.uses_control else {})}

    @cached_property
    def _template_start(self) -> int:  # measured once, as the video family's
        tok = self.load_tokenizer()
        return template_start(getattr(tok, "tokenizer", tok), self.template)

    # -- encoding ------------------------------------------------------------------
    def encode_text(self, encoders: TextBundle, captions: list[str],
                    images: list[Image.Image | None] | None = None) -> dict[str, torch.Tensor]:
        """Text-to-image: ``kandinsky5``'s. Editing: each caption alone with its control image through the
        editing pipeline's ``encode_prompt`` (the image at half its size after the caption), left-aligned
        rows, a mask, the pooled CLIP output."""
        if not self.uses_control:
            return super().encode_text(encoders, captions)
        images = list(images) if images is not None else [None] * len(captions)

        def encode(pipe, i, caption, width, device):
            if images[i] is None:  # the empty caption's cache (caption dropout is refused for edit families)
                return self._without_image(pipe, caption, width, device)
            qwen, clip, _ = pipe.encode_prompt([caption], image=images[i], max_sequence_length=width, device=device,
                                               dtype=torch.float32)
            return qwen, clip

        return super().encode_text(encoders, captions, encode)

    def _without_image(self, pipe: Kandinsky5I2IPipeline, caption: str, width: int,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """A caption without an image: the editing template less its vision slot, as ``_encode_prompt_qwen``
        encodes it otherwise (the last hidden states after the template's start), and its CLIP output."""
        text = self.template.replace(VISION_SLOT, "").format(caption)
        start = pipe.prompt_template_encode_start_idx
        inputs = pipe.tokenizer(text=[text], images=None, max_length=start + width, truncation=True,
                                return_tensors="pt").to(device)
        hidden = pipe.text_encoder(**inputs, return_dict=True, output_hidden_states=True)["hidden_states"][-1]
        return hidden[:, start:], pipe._encode_prompt_clip([caption], device=device, dtype=torch.float32)

    def count_tokens(self, encoders: TextBundle, captions: list[str]) -> dict[str, list[int]]:
        if not self.uses_control:
            return super().count_tokens(encoders, captions)
        # The caption's share of the Qwen tokens (the image's vision tokens come on top).
        tok = encoders.tokenizer.tokenizer
        start = template_start(tok, self.template)
        templated = tok([self.template.format(c) for c in self.caption_prompts(captions)]).input_ids
        return {"qwen2.5-vl": [len(x) - start for x in templated],
                "clip": [len(x) for x in encoders.tokenizer_2(list(captions)).input_ids]}

    # -- training ------------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32, control: torch.Tensor | None = None) -> Prepared:
        """Images ``[B, C, h, w]`` as one-frame clips (noise and mask too), then ``kandinsky5``'s inputs.
        Editing: the control latents and a mask of ones in the visual-condition channels."""
        if latents.ndim not in (4, 5):
            raise ValueError(f"family {self.name!r} trains on [B,C,h,w] latents, got {tuple(latents.shape)}")
        if self.uses_control and control is None:
            raise ValueError("model.variant i2i needs a control image per item (the image to edit): set "
                             "datasets[].control_path / control_column")

        def framed(x: torch.Tensor | None) -> torch.Tensor | None:
            return x if x is None or x.ndim == 5 else x[:, :, None]

        p = Kandinsky5Family.prepare(self, framed(latents), text, generator, objective=objective, t=t,
                                     noise=framed(noise), mask=framed(mask), dtype=dtype)
        if self.uses_control:
            hidden = p.inputs["hidden_states"]  # [B, 1, h, w, 2C + 1]: noisy, zeros, a zero mask
            c = (hidden.shape[-1] - 1) // 2
            image = framed(control)[:, :, :1].to(hidden).permute(0, 2, 3, 4, 1)
            p.inputs["hidden_states"] = torch.cat([hidden[..., :c], image, torch.ones_like(hidden[..., :1])], -1)
        return p

    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        if self.uses_control:
            raise ValueError("kandinsky5-image i2i: pipeline parallelism is not implemented for the editing "
                             "checkpoints; set train.pipeline_stages: 1")
        return super().pipeline_layers(denoiser)

    def sample_kwargs(self, cfg) -> dict[str, Any]:
        if self.uses_control and not cfg.images:
            raise ValueError("sample.images: Kandinsky 5.0 Image Lite i2i edits an image; give one per sample.prompts")
        return super().sample_kwargs(cfg)
