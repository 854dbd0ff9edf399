"""Family ``flux``: Flux-style transformer, flow matching, CLIP pooled + T5 sequence text.

Components and names follow ``FluxPipeline``: ``vae`` (AutoencoderKL),
``text_encoder`` (CLIPTextModel, pooled output) + ``tokenizer``,
``text_encoder_2`` (T5EncoderModel, sequence output) + ``tokenizer_2``,
``transformer`` (FluxTransformer2DModel), ``scheduler``
(FlowMatchEulerDiscreteScheduler). Latents are packed into 2x2 patches with
the pipeline's own helpers, so training sees exactly what inference sees.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
)
from transformers import (
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
)

from diffpipe.config import SampleConfig
from diffpipe.families.flux.flavors import TINY_SCHEDULER, TINY_T5, TINY_T5_LENGTH, TINY_TRANSFORMER, TINY_VAE
from diffpipe.families.flux.layers import ROUTED, flux_layers
from diffpipe.models import _common as common
from diffpipe.models import targets
from diffpipe.models.base import Family, Prepared
from diffpipe.models.components import Model, TextBundle, TextEncoder, TextPart, Tokenizer, clip_text_encoder
from diffpipe.models.tokenizers import t5_tokenizer

# FluxPipeline refuses longer T5 prompts.
MAX_T5_LENGTH = 512


_tiny_t5 = common.tiny_text_model(T5EncoderModel, T5Config, TINY_T5, "flux.text_encoder_2", common.T5_IDS)

def _clip_pooled(encoder: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """CLIP-L's pooled output, as FluxPipeline._get_clip_prompt_embeds takes it."""
    return encoder(ids.to(next(encoder.parameters()).device), output_hidden_states=False).pooler_output


class FluxFamily(Family):
    vae_shift = True
    # Seeded as "lux.vae" / "lux.transformer" since the tiny flavor's first weights (golden losses).
    vae_model = Model(AutoencoderKL, TINY_VAE, seed="lux")
    denoiser_model = Model(FluxTransformer2DModel, TINY_TRANSFORMER, seed="lux")
    text_parts: ClassVar[dict[str, TextPart]] = {
        **clip_text_encoder("flux.text_encoder", "text_encoder", stream="clip"),
        "tokenizer_2": Tokenizer(T5TokenizerFast, lambda: t5_tokenizer(TINY_T5_LENGTH), "t5"),
        "text_encoder_2": TextEncoder(T5EncoderModel, T5Config, _tiny_t5),
    }
    pipeline_class = FluxPipeline
    #: CLIP-L (its pooled output) may train; T5 stays cached. kohya and ComfyUI name it lora_te1.
    trainable_text_encoders: ClassVar[dict[str, str]] = {"text_encoder": "lora_te1"}
    patch = 2  # the pipeline packs 2x2 latents into a token (the config's patch_size is 1)
    prompt_tokens = (TINY_T5_LENGTH, MAX_T5_LENGTH)
    prompt_tokenizer = "tokenizer_2"
    # As in diffusers' Flux DreamBooth LoRA example: attention projections of
    # both streams (image: to_*, text: add_*_proj / to_add_out; the names
    # also match the single blocks' q/k/v) and the feed-forward linears of
    # both streams in the double blocks.
    default_lora_targets: ClassVar[list[str]] = targets.dual_stream()
    #: Distilled guidance fed to guidance-embedding models while training
    #: (1.0 is the common choice for LoRAs on FLUX.1-dev).
    train_guidance: ClassVar[float] = 1.0
    token_routing = ROUTED

    def sampling_key(self) -> str | None:
        """``schnell`` for FLUX.1-schnell's weights: FLUX.1-dev's transformer config without the guidance
        embedder (``guidance_embeds: false``, as published); a config without the key (Chroma's) is not it."""
        return "schnell" if self._denoiser_config.get("guidance_embeds") is False else super().sampling_key()

    # -- configs -------------------------------------------------------------
    @cached_property
    def _scheduler_config(self) -> dict[str, Any]:
        if self.cfg.flavor == "tiny":
            return dict(TINY_SCHEDULER)
        return dict(
            FlowMatchEulerDiscreteScheduler.load_config(self.cfg.path, subfolder="scheduler")
        )

    def shift_for(self, x0: torch.Tensor) -> float:
        return self.timestep_shift((x0.shape[-2] // 2) * (x0.shape[-1] // 2))

    # -- components ------------------------------------------------------------
    def inference_scheduler(self) -> FlowMatchEulerDiscreteScheduler:
        return FlowMatchEulerDiscreteScheduler.from_config(self._scheduler_config)

    # -- identities ------------------------------------------------------------
    # -- encoding --------------------------------------------------------------
    def encode_text(
        self, encoders: TextBundle, captions: list[str]
    ) -> dict[str, torch.Tensor]:
        # Exactly FluxPipeline._get_clip_prompt_embeds / _get_t5_prompt_embeds.
        enc = encoders
        clip_ids = enc.tokenizer(
            captions,
            padding="max_length",
            max_length=enc.tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        t5_ids = enc.tokenizer_2(
            captions,
            padding="max_length",
            max_length=enc.max_sequence_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        with torch.no_grad():
            device = next(enc.text_encoder_2.parameters()).device
            embeds = enc.text_encoder_2(t5_ids.to(device), output_hidden_states=False)[0]
            if self.trained_text:  # CLIP-L trained (train.text_encoder): it runs at every step (embed_ids)
                return {"prompt_embeds": embeds.float(), "input_ids": clip_ids}
            pooled = _clip_pooled(enc.text_encoder, clip_ids)
        return {"prompt_embeds": embeds.float(), "pooled_prompt_embeds": pooled.float()}

    def embed_ids(self, encoders, text):
        return {"prompt_embeds": text["prompt_embeds"],
                "pooled_prompt_embeds": _clip_pooled(encoders["text_encoder"], text["input_ids"]).float()}

    # -- training ----------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32) -> Prepared:
        """Packed noisy latents, sigma, guidance, pooled and T5 text, text and image ids; a packed target."""
        f = self.flow_draw(latents, generator, objective, t, noise, FluxPipeline._pack_latents)
        device, b = f.x0.device, f.x0.shape[0]
        prompt_embeds = text["prompt_embeds"].to(device=device, dtype=dtype)
        inputs = {
            "hidden_states": f.noisy.to(dtype),
            # FluxPipeline passes sigma (its timestep / 1000) in the latents' dtype.
            "timestep": f.sigma.to(dtype),
            "guidance": torch.full((b,), self.train_guidance, device=device, dtype=torch.float32),
            "pooled_projections": text["pooled_prompt_embeds"].to(device=device, dtype=dtype),
            "encoder_hidden_states": prompt_embeds,
            "txt_ids": torch.zeros(prompt_embeds.shape[1], 3, device=device, dtype=dtype),
            "img_ids": FluxPipeline._prepare_latent_image_ids(b, *f.grid, device, dtype),
        }
        return self.flow_prepared(f, inputs, mask, objective)

    # -- sampling ----------------------------------------------------------------
    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        return {**super().sample_kwargs(cfg), "max_sequence_length": self.max_sequence_length}

    # -- pipeline parallelism ------------------------------------------------------
    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """The transformer as layers: embedding, one per double and single block, output.

        Input tuple ``(packed_noisy, sigma, guidance, pooled, prompt_embeds, txt_ids, img_ids)``;
        output ``(packed prediction,)``.
        """
        return flux_layers(common.unwrap(denoiser))
