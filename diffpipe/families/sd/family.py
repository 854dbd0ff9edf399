"""Family ``sd``: SD-style UNet, DDPM noise schedule, one CLIP text encoder.

Components and names follow ``StableDiffusionPipeline``: ``vae``
(AutoencoderKL), ``text_encoder`` (CLIPTextModel) + ``tokenizer``, ``unet``
(UNet2DConditionModel), ``scheduler``. Training draws integer DDPM steps
uniformly and predicts epsilon or v; sampling uses DDIM on the same betas.
``model.zero_terminal_snr`` rescales those betas to zero terminal SNR (Lin et
al. 2024) for training and sampling alike, sampled with trailing timesteps.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    DDPMScheduler,
    StableDiffusionPipeline,
    UNet2DConditionModel,
)

from diffpipe.config import ObjectiveConfig
from diffpipe.families.sd.flavors import TINY_SCHEDULER, TINY_UNET, TINY_VAE
from diffpipe.families.sd.layers import unet_layers
from diffpipe.models import _common as common
from diffpipe.models import objectives as obj
from diffpipe.models._draws import ddpm_parts, draw_image
from diffpipe.models.base import Family, Prepared
from diffpipe.models.components import Model, TextBundle, TextPart, clip_text_encoder


def _no_attention_mask(encoder: torch.nn.Module) -> None:
    """Token ids alone reproduce the pipeline's encoding only for encoders that take no attention mask
    (CLIP's ``use_attention_mask`` unset, as in SD 1.x/2.x; the pad token equals the end token there)."""
    if getattr(encoder.config, "use_attention_mask", False):
        raise ValueError("train.text_encoder: this text encoder's config sets use_attention_mask, which cached "
                         "token ids cannot carry; train the denoiser only")


class SDFamily(Family):
    vae_model = Model(AutoencoderKL, TINY_VAE)
    denoiser_model = Model(UNet2DConditionModel, TINY_UNET)
    text_parts: ClassVar[dict[str, TextPart]] = clip_text_encoder("sd.text_encoder", "text_encoder", stream="clip")
    pipeline_extras: ClassVar[dict[str, Any]] = {
        "safety_checker": None, "feature_extractor": None, "requires_safety_checker": False,
    }
    vae_needs_fp32 = True  # fp16 overflows in its decoder; kohya and musubi keep it in float32 too
    denoiser_name = "unet"
    pipeline_class = StableDiffusionPipeline
    trainable_text_encoders: ClassVar[dict[str, str]] = {"text_encoder": "lora_te"}
    # Attention projections are the usual SD LoRA targets. On the tiny UNet
    # they are a small share of the network (one cross-attention block each
    # way), so alone they barely move the loss; the ResNet convolutions and
    # the time-embedding projections (LoCon-style, supported by PEFT and by
    # diffusers' LoRA loader) let it learn noticeably within a few steps.
    default_lora_targets: ClassVar[list[str]] = [
        "to_k",
        "to_q",
        "to_v",
        "to_out.0",
        "proj_in",
        "proj_out",
        "ff.net.0.proj",
        "ff.net.2",
        "conv1",
        "conv2",
        "time_emb_proj",
    ]

    # -- configs (read once per instance: local ones live on disk) -------------
    @cached_property
    def _scheduler_config(self) -> dict[str, Any]:
        if self.cfg.flavor == "tiny":
            config = dict(TINY_SCHEDULER)
        else:
            # Any scheduler's config (PNDM in SD 1.5 folders) carries the betas.
            config = dict(DDIMScheduler.load_config(self.cfg.path, subfolder="scheduler"))
        return self._schedule_options(config)

    def _schedule_options(self, config: dict[str, Any]) -> dict[str, Any]:
        """``config`` with the model section's prediction type and zero-terminal-SNR choice applied."""
        if self.cfg.prediction_type:
            config["prediction_type"] = self.cfg.prediction_type
        if self.cfg.zero_terminal_snr is not None:
            config["rescale_betas_zero_snr"] = self.cfg.zero_terminal_snr
        if config.get("rescale_betas_zero_snr"):
            if config.get("prediction_type", "epsilon") != "v_prediction":
                source = "the tiny flavor's" if self.cfg.flavor == "tiny" else f"{self.cfg.path}/scheduler's"
                raise ValueError(
                    f"model.zero_terminal_snr needs model.prediction_type: v_prediction, but {source} prediction "
                    f"type is {config.get('prediction_type', 'epsilon')!r} (the noise is undefined to predict at "
                    "zero SNR); set model.prediction_type: v_prediction or model.zero_terminal_snr: false"
                )
            # Sampling must start at the last (pure-noise) timestep (Lin et al. 2024, section 3.3).
            config["timestep_spacing"] = "trailing"
        return config

    @cached_property
    def prediction_type(self) -> str:
        """``epsilon`` or ``v_prediction``: the config's choice, else the scheduler's."""
        return self._scheduler_config.get("prediction_type", "epsilon")

    @property
    def pixel_multiple(self) -> int:
        # VAE downsampling x UNet downsampling, so every UNet level has whole pixels.
        vae_factor = 2 ** (len(self._vae_config["block_out_channels"]) - 1)
        unet_factor = 2 ** (len(self._denoiser_config["block_out_channels"]) - 1)
        return vae_factor * unet_factor

    # -- components ------------------------------------------------------------
    @property
    def zero_terminal_snr(self) -> bool:
        """Whether the schedule is rescaled to zero terminal SNR (``model.zero_terminal_snr`` or the scheduler's)."""
        return bool(self._scheduler_config.get("rescale_betas_zero_snr"))

    def noise_scheduler(self) -> DDPMScheduler:
        """The training schedule (its ``alphas_cumprod`` noise the latents)."""
        return DDPMScheduler.from_config(self._scheduler_config)

    def inference_scheduler(self) -> DDIMScheduler:
        """DDIM on the training betas, with the training prediction type."""
        return DDIMScheduler.from_config(self._scheduler_config)

    # -- encoding --------------------------------------------------------------
    def encode_text(self, encoders: TextBundle, captions: list[str]) -> dict[str, torch.Tensor]:
        tok, encoder = encoders.tokenizer, encoders.text_encoder
        # Exactly StableDiffusionPipeline.encode_prompt (no clip_skip).
        ids = tok(
            captions,
            padding="max_length",
            max_length=tok.model_max_length,
            truncation=True,
            return_tensors="pt",
        )
        if self.trained_text:  # the trained encoder runs at every step (embed_ids)
            _no_attention_mask(encoder)
            return {"input_ids": ids.input_ids}
        device = next(encoder.parameters()).device
        mask = None
        if getattr(encoder.config, "use_attention_mask", False):
            mask = ids.attention_mask.to(device)
        with torch.no_grad():
            embeds = encoder(ids.input_ids.to(device), attention_mask=mask)[0]
        return {"prompt_embeds": embeds.float()}

    def embed_ids(self, encoders, text):
        encoder = encoders["text_encoder"]
        _no_attention_mask(encoder)
        return {"prompt_embeds": encoder(text["input_ids"].to(next(encoder.parameters()).device))[0]}

    # -- training ----------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32) -> Prepared:
        """``inputs`` = ``(sample, timestep, encoder_hidden_states)``: the noisy latents, DDPM steps, text."""
        o = objective
        self._check_objective(o)
        x0 = common.single_frame(latents, self.name).float()
        t, noise = draw_image(o, x0, generator, t, noise, family=self.name, default="uniform", offset_noise=True)
        noisy, steps, target, weights = ddpm_parts(o, x0, noise, t, self._alphas_cumprod, self.prediction_type)
        inputs = {
            "sample": noisy.to(dtype),
            "timestep": steps,
            "encoder_hidden_states": text["prompt_embeds"].to(device=x0.device, dtype=dtype),
        }
        return Prepared(inputs, target, weights, self.loss_mask(mask, x0, o))

    @cached_property
    def _alphas_cumprod(self) -> torch.Tensor:
        # Built once: loss() runs every step.
        if not self.zero_terminal_snr:
            return self.noise_scheduler().alphas_cumprod.clone()
        # Our own rescaling of the plain betas; the samplers get the same schedule from
        # the scheduler option ``rescale_betas_zero_snr`` (a test checks they agree).
        plain = DDPMScheduler.from_config({**self._scheduler_config, "rescale_betas_zero_snr": False})
        return torch.cumprod(1.0 - obj.rescale_zero_terminal_snr(plain.betas), dim=0)

    @staticmethod
    def _check_objective(o: ObjectiveConfig) -> None:
        if o.weighting_scheme is not None:
            raise ValueError(
                f"train.objective.weighting_scheme {o.weighting_scheme!r} applies to flow-matching families "
                "(sd3); UNet families weight the loss with train.objective.min_snr_gamma"
            )

    # -- pipeline parallelism ------------------------------------------------------
    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """The UNet as layers: embedding, one per down block, mid block, one per up block, output.

        Input tuple ``(noisy, timesteps, prompt_embeds)``; output ``(prediction,)``.
        """
        return unet_layers(common.unwrap(denoiser))
