"""Family ``sdxl``: the SDXL UNet, two CLIP text encoders, pooled text and size/crop conditioning.

Components and names follow ``StableDiffusionXLPipeline``: ``vae``,
``text_encoder`` (CLIPTextModel) + ``tokenizer``, ``text_encoder_2``
(CLIPTextModelWithProjection, also the pooled embedding) + ``tokenizer_2``,
``unet`` (UNet2DConditionModel with ``addition_embed_type="text_time"``),
``scheduler`` (Euler on the DDPM betas). Training is DDPM as in ``sd``
(epsilon or v), plus SDXL's micro-conditioning: ``add_time_ids`` =
(original height, width, crop top, left, target height, width) per item
(Podell et al. 2023, section 2.2): the source image's size and the crop the
cache actually applied (planned per item, :func:`diffpipe.data.cache.buckets.crop_top_left`),
and the bucket it was trained at.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKL,
    EulerDiscreteScheduler,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from transformers import (
    CLIPTextModelWithProjection,
)

from diffpipe.families.sd.family import TINY_SCHEDULER, SDFamily
from diffpipe.families.sd.layers import unet_layers
from diffpipe.families.sdxl.flavors import TINY_UNET, TINY_VAE_XL
from diffpipe.models import _common as common
from diffpipe.models.base import Prepared, ids_name
from diffpipe.models.components import Model, TextBundle, TextPart, clip_text_encoder


def time_ids(original_hw: torch.Tensor, crop_top_left: torch.Tensor, target_hw: torch.Tensor) -> torch.Tensor:
    """SDXL's ``add_time_ids`` ``[B, 6]``: original (h, w), crop (top, left), target (h, w).

    The same order as ``StableDiffusionXLPipeline._get_add_time_ids``.
    """
    return torch.cat([original_hw, crop_top_left, target_hw], dim=1).float()


def _clip_states(encoder: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A CLIP encoder's penultimate hidden states and, for the projection model, its pooled output."""
    out = encoder(ids.to(next(encoder.parameters()).device), output_hidden_states=True)
    return out.hidden_states[-2], (out[0] if out[0].ndim == 2 else None)


class SDXLFamily(SDFamily):
    vae_model = Model(AutoencoderKL, TINY_VAE_XL)
    denoiser_model = Model(UNet2DConditionModel, TINY_UNET)
    text_parts: ClassVar[dict[str, TextPart]] = {
        **clip_text_encoder("sdxl.text_encoder", "text_encoder", stream="clip_l"),
        **clip_text_encoder("sdxl.text_encoder_2", cls=CLIPTextModelWithProjection, stream="clip_g"),
    }
    pipeline_extras: ClassVar[dict[str, Any]] = {"add_watermarker": False}
    uses_sizes = True
    denoiser_name = "unet"
    pipeline_class = StableDiffusionXLPipeline
    trainable_text_encoders: ClassVar[dict[str, str]] = {"text_encoder": "lora_te1", "text_encoder_2": "lora_te2"}
    #: The common SDXL LoRA targets (kohya / diffusers examples): attention and
    #: feed-forward of every transformer block, plus the ResNet convolutions
    #: as in ``sd`` so the tiny model learns within a few steps.
    default_lora_targets: ClassVar[list[str]] = SDFamily.default_lora_targets

    @cached_property
    def _scheduler_config(self) -> dict[str, Any]:
        config = dict(TINY_SCHEDULER) if self.cfg.flavor == "tiny" else dict(
            EulerDiscreteScheduler.load_config(self.cfg.path, subfolder="scheduler"))
        return self._schedule_options(config)

    def inference_scheduler(self) -> EulerDiscreteScheduler:
        return EulerDiscreteScheduler.from_config(self._scheduler_config)

    # -- encoding ----------------------------------------------------------------
    #: Each encoder's tokenizer, and the cache columns of its token ids (trained) or hidden states.
    _PAIRS = (("tokenizer", "text_encoder", "prompt_embeds_1"), ("tokenizer_2", "text_encoder_2", "prompt_embeds_2"))

    def encode_text(self, encoders: TextBundle, captions: list[str]) -> dict[str, torch.Tensor]:
        # Exactly StableDiffusionXLPipeline.encode_prompt (no clip_skip): the
        # penultimate hidden states of both encoders side by side, and the
        # second encoder's projected pooled output. A trained encoder's captions
        # are cached as token ids and encoded at every step (embed_ids).
        out: dict[str, torch.Tensor] = {}
        for tok_name, enc_name, part in self._PAIRS:
            tok = getattr(encoders, tok_name)
            ids = tok(captions, padding="max_length", max_length=tok.model_max_length, truncation=True,
                      return_tensors="pt").input_ids
            if enc_name in self.trained_text:
                out[ids_name(enc_name)] = ids
                continue
            with torch.no_grad():
                hidden, pooled = _clip_states(getattr(encoders, enc_name), ids)
            out[part] = hidden.float()
            if pooled is not None:
                out["pooled_prompt_embeds"] = pooled.float()
        if not self.trained_text:
            return {"prompt_embeds": torch.cat([out.pop("prompt_embeds_1"), out.pop("prompt_embeds_2")], dim=-1),
                    "pooled_prompt_embeds": out["pooled_prompt_embeds"]}
        return out

    def embed_ids(self, encoders, text):
        embeds, pooled = [], text.get("pooled_prompt_embeds")
        for _, enc_name, part in self._PAIRS:
            if enc_name not in encoders:
                embeds.append(text[part])
                continue
            hidden, p = _clip_states(encoders[enc_name], text[ids_name(enc_name)])
            embeds.append(hidden)
            pooled = p if p is not None else pooled
        return {"prompt_embeds": torch.cat([e.float() for e in embeds], dim=-1), "pooled_prompt_embeds": pooled.float()}

    # -- training ----------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32, sizes: dict[str, torch.Tensor] | None = None) -> Prepared:
        """As ``sd``'s inputs, with SDXL's pooled text and ``add_time_ids`` (``added_cond_kwargs``).

        ``sizes`` (the batch's ``sizes``, optional): ``original_size`` and
        ``crop_top_left``, ``[B, 2]`` pixels (height, width / top, left). Without
        it the item is taken as resized to the bucket with no crop (original =
        target, crop 0, 0), as for caches planned before the plan recorded them.
        """
        p = super().prepare(latents, text, generator, objective=objective, t=t, noise=noise, mask=mask, dtype=dtype)
        (b, _, h, w), device = p.target.shape, p.target.device
        target_hw = torch.tensor([[h * self.vae_factor, w * self.vae_factor]], device=device).expand(b, 2)
        sizes = sizes or {}
        ids = time_ids(sizes.get("original_size", target_hw).to(device),
                       sizes.get("crop_top_left", torch.zeros_like(target_hw)).to(device), target_hw)
        p.inputs["added_cond_kwargs"] = {"text_embeds": text["pooled_prompt_embeds"].to(device=device, dtype=dtype),
                                         "time_ids": ids.to(dtype)}
        return p

    def layer_inputs(self, prepared: Prepared) -> tuple[torch.Tensor, ...]:
        """``(noisy, timesteps, prompt_embeds, pooled_prompt_embeds, add_time_ids)``."""
        i = prepared.inputs
        return (i["sample"], i["timestep"], i["encoder_hidden_states"], i["added_cond_kwargs"]["text_embeds"],
                i["added_cond_kwargs"]["time_ids"])

    # -- pipeline parallelism ------------------------------------------------------
    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """The UNet as layers, as ``sd``'s, with the ``text_time`` embedding in the first.

        Input tuple ``(noisy, timesteps, prompt_embeds, pooled_prompt_embeds, add_time_ids)``;
        output ``(prediction,)``.
        """
        return unet_layers(common.unwrap(denoiser))
