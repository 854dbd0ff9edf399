"""Family ``sd3``: Stable Diffusion 3 / 3.5 (MMDiT), three text encoders, flow matching.

Components and names follow ``StableDiffusion3Pipeline``: ``vae``,
``text_encoder`` / ``text_encoder_2`` (CLIP-L and CLIP-G with projection:
penultimate hidden states side by side, pooled outputs concatenated) with
``tokenizer`` / ``tokenizer_2``, ``text_encoder_3`` (T5) + ``tokenizer_3``,
``transformer`` (SD3Transformer2DModel), ``scheduler``
(FlowMatchEulerDiscreteScheduler, fixed shift 3). Training is rectified flow
with logit-normal timesteps by default, or the SD3 paper's timestep densities
and loss weightings (Esser et al. 2024, section 3.1) through
``train.objective.weighting_scheme`` (``logit_normal``, ``mode``,
``sigma_sqrt``, ``cosmap``, ``none``; pure functions in
:mod:`diffpipe.training.objectives`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
)

from diffpipe.config import ObjectiveConfig, SampleConfig
from diffpipe.families.sd3.flavors import TINY_SCHEDULER, TINY_T5, TINY_T5_LENGTH, TINY_TRANSFORMER, TINY_VAE
from diffpipe.models import _common as common
from diffpipe.models._draws import draw_image
from diffpipe.models.base import Family, Prepared
from diffpipe.models.tokenizers import clip_tokenizer, t5_tokenizer, tokenizer_fingerprint
from diffpipe.training import objectives as obj
from diffpipe.utils import digest

#: StableDiffusion3Pipeline's default T5 length.
T5_LENGTH = 256


@dataclass
class SD3TextEncoders:
    tokenizer: CLIPTokenizer
    text_encoder: CLIPTextModelWithProjection
    tokenizer_2: CLIPTokenizer
    text_encoder_2: CLIPTextModelWithProjection
    tokenizer_3: T5TokenizerFast
    text_encoder_3: T5EncoderModel
    max_sequence_length: int

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> SD3TextEncoders:
        for enc in (self.text_encoder, self.text_encoder_2, self.text_encoder_3):
            enc.to(device=device, dtype=dtype)
        return self


def _tiny_clip(tok: CLIPTokenizer, seed: int, component: str) -> CLIPTextModelWithProjection:
    config = CLIPTextConfig(**common.TINY_CLIP, vocab_size=len(tok), max_position_embeddings=tok.model_max_length,
                            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id)
    with common.seeded(seed, component):
        return CLIPTextModelWithProjection(config).eval()


def _tiny_t5(tok: T5TokenizerFast, seed: int, component: str, **overrides) -> T5EncoderModel:
    config = T5Config(**{**TINY_T5, **overrides}, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, decoder_start_token_id=tok.pad_token_id)
    with common.seeded(seed, component):
        return T5EncoderModel(config).eval()


class SD3Family(Family):
    name = "sd3"
    vae_class = AutoencoderKL
    denoiser_name = "transformer"
    #: diffusers' SD3 DreamBooth LoRA example: attention of both streams
    #: (image ``to_*``, text ``add_*_proj`` / ``to_add_out``) and both
    #: feed-forwards of every joint block.
    default_lora_targets: ClassVar[list[str]] = [
        "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
        "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
        "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
    ]
    #: How many CLIP text encoders feed the pooled and sequence embeddings.
    clip_components: ClassVar[tuple[str, ...]] = ("text_encoder", "text_encoder_2")

    @cached_property
    def _vae_config(self) -> dict[str, Any]:
        if self.cfg.flavor == "tiny":
            return dict(TINY_VAE)
        return dict(AutoencoderKL.load_config(self.cfg.path, subfolder="vae"))

    @cached_property
    def _transformer_config(self) -> dict[str, Any]:
        if self.cfg.flavor == "tiny":
            return dict(TINY_TRANSFORMER)
        return dict(SD3Transformer2DModel.load_config(self.cfg.path, subfolder="transformer"))

    @cached_property
    def _scheduler_config(self) -> dict[str, Any]:
        if self.cfg.flavor == "tiny":
            return dict(TINY_SCHEDULER)
        return dict(FlowMatchEulerDiscreteScheduler.load_config(self.cfg.path, subfolder="scheduler"))

    @cached_property
    def max_sequence_length(self) -> int:
        """T5 tokens per prompt: the pipeline's default 256, or less if the T5 tokenizer says so."""
        if self.cfg.flavor == "tiny":
            return TINY_T5_LENGTH
        config_file = Path(self.cfg.path) / "tokenizer_3" / "tokenizer_config.json"
        length = json.loads(config_file.read_text()).get("model_max_length", T5_LENGTH)
        return min(int(length), T5_LENGTH)

    @property
    def pixel_multiple(self) -> int:
        vae = 2 ** (len(self._vae_config["block_out_channels"]) - 1)
        return vae * self._transformer_config.get("patch_size", 2)

    # -- components ------------------------------------------------------------
    def load_vae(self) -> AutoencoderKL:
        return common.component(AutoencoderKL, self.cfg, self.name, "vae", TINY_VAE)

    def load_tokenizers(self) -> SD3TextEncoders:
        msl = self.max_sequence_length
        if self.cfg.flavor == "tiny":
            return SD3TextEncoders(clip_tokenizer(), None, clip_tokenizer(), None, t5_tokenizer(msl), None, msl)
        p = self.cfg.path
        return SD3TextEncoders(CLIPTokenizer.from_pretrained(p, subfolder="tokenizer"), None,
                               CLIPTokenizer.from_pretrained(p, subfolder="tokenizer_2"), None,
                               T5TokenizerFast.from_pretrained(p, subfolder="tokenizer_3"), None, msl)

    def load_text_encoders(self) -> SD3TextEncoders:
        msl, seed = self.max_sequence_length, self.cfg.seed
        if self.cfg.flavor == "tiny":
            tok, tok2, tok3 = clip_tokenizer(), clip_tokenizer(), t5_tokenizer(msl)
            return SD3TextEncoders(tok, _tiny_clip(tok, seed, "sd3.text_encoder"),
                                   tok2, _tiny_clip(tok2, seed, "sd3.text_encoder_2"),
                                   tok3, _tiny_t5(tok3, seed, "sd3.text_encoder_3"), msl)
        enc = self.load_tokenizers()
        enc.text_encoder = common.pretrained_text_encoder(CLIPTextModelWithProjection, self.cfg, "text_encoder")
        enc.text_encoder_2 = common.pretrained_text_encoder(CLIPTextModelWithProjection, self.cfg, "text_encoder_2")
        enc.text_encoder_3 = common.pretrained_text_encoder(T5EncoderModel, self.cfg, "text_encoder_3")
        return enc

    def load_denoiser(self) -> SD3Transformer2DModel:
        return common.component(SD3Transformer2DModel, self.cfg, self.name, "transformer", TINY_TRANSFORMER)

    def inference_scheduler(self) -> FlowMatchEulerDiscreteScheduler:
        return FlowMatchEulerDiscreteScheduler.from_config(self._scheduler_config)

    def load_pipeline(self) -> StableDiffusion3Pipeline:
        e = self.load_text_encoders()
        return StableDiffusion3Pipeline(
            transformer=self.load_denoiser(), scheduler=self.inference_scheduler(), vae=self.load_vae(),
            text_encoder=e.text_encoder, tokenizer=e.tokenizer, text_encoder_2=e.text_encoder_2,
            tokenizer_2=e.tokenizer_2, text_encoder_3=e.text_encoder_3, tokenizer_3=e.tokenizer_3,
        )

    @property
    def pipeline_class(self) -> type:
        return StableDiffusion3Pipeline

    # -- identities ------------------------------------------------------------
    def encoders_identity(self) -> str:
        if self.cfg.flavor == "tiny":
            return common.memo_identity((self.name, self.cfg.seed, "text"),
                                        lambda: self._text_identity(self.load_text_encoders()))
        p, tok = self.cfg.path, self.load_tokenizers()
        return digest({
            "tokenizer": tokenizer_fingerprint(tok.tokenizer),
            "tokenizer_2": tokenizer_fingerprint(tok.tokenizer_2),
            "tokenizer_3": tokenizer_fingerprint(tok.tokenizer_3),
            "text_encoder": common.transformers_folder_identity(
                CLIPTextModelWithProjection, CLIPTextConfig, p, "text_encoder", variant=self.cfg.weight_variant),
            "text_encoder_2": common.transformers_folder_identity(
                CLIPTextModelWithProjection, CLIPTextConfig, p, "text_encoder_2", variant=self.cfg.weight_variant),
            "text_encoder_3": common.transformers_folder_identity(T5EncoderModel, T5Config, p, "text_encoder_3", variant=self.cfg.weight_variant),
            "max_sequence_length": self.max_sequence_length,
        })

    @staticmethod
    def _text_identity(e: SD3TextEncoders) -> str:
        return digest({
            "tokenizer": tokenizer_fingerprint(e.tokenizer),
            "tokenizer_2": tokenizer_fingerprint(e.tokenizer_2),
            "tokenizer_3": tokenizer_fingerprint(e.tokenizer_3),
            "text_encoder": common.module_identity(e.text_encoder),
            "text_encoder_2": common.module_identity(e.text_encoder_2),
            "text_encoder_3": common.module_identity(e.text_encoder_3),
            "max_sequence_length": e.max_sequence_length,
        })

    # -- encoding --------------------------------------------------------------
    def encode_pixels(self, vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        frames = pixels.shape[2]
        param = next(vae.parameters())
        with torch.no_grad():
            x = common.frames_to_batch(pixels).to(device=param.device, dtype=param.dtype)
            latents = vae.encode(x).latent_dist.mode()
        # Inverse of the pipeline's decode: ``latents / scaling_factor + shift_factor``.
        shift = vae.config.shift_factor or 0.0
        latents = (latents.float() - shift) * vae.config.scaling_factor
        return common.batch_to_frames(latents, frames)

    def encode_text(self, encoders: SD3TextEncoders, captions: list[str]) -> dict[str, torch.Tensor]:
        # Exactly StableDiffusion3Pipeline.encode_prompt (no clip_skip).
        e, clip_embeds, pooled = encoders, [], []
        with torch.no_grad():
            for tok, enc in ((e.tokenizer, e.text_encoder), (e.tokenizer_2, e.text_encoder_2)):
                ids = tok(captions, padding="max_length", max_length=tok.model_max_length, truncation=True,
                          return_tensors="pt").input_ids
                out = enc(ids.to(next(enc.parameters()).device), output_hidden_states=True)
                pooled.append(out[0])
                clip_embeds.append(out.hidden_states[-2])
            ids = e.tokenizer_3(captions, padding="max_length", max_length=e.max_sequence_length, truncation=True,
                                add_special_tokens=True, return_tensors="pt").input_ids
            t5 = e.text_encoder_3(ids.to(next(e.text_encoder_3.parameters()).device))[0]
        clip = torch.cat(clip_embeds, dim=-1)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return {"prompt_embeds": torch.cat([clip, t5], dim=-2).float(),
                "pooled_prompt_embeds": torch.cat(pooled, dim=-1).float()}

    def token_limits(self, encoders: SD3TextEncoders) -> dict[str, int]:
        return {"clip_l": encoders.tokenizer.model_max_length, "clip_g": encoders.tokenizer_2.model_max_length,
                "t5": encoders.max_sequence_length}

    def count_tokens(self, encoders: SD3TextEncoders, captions: list[str]) -> dict[str, list[int]]:
        captions = list(captions)
        return {"clip_l": [len(x) for x in encoders.tokenizer(captions).input_ids],
                "clip_g": [len(x) for x in encoders.tokenizer_2(captions).input_ids],
                "t5": [len(x) for x in encoders.tokenizer_3(captions).input_ids]}

    # -- training ----------------------------------------------------------------
    def sample_t(self, o: ObjectiveConfig, b: int, generator: torch.Generator) -> torch.Tensor:
        """Training timesteps before the shift.

        ``train.objective.weighting_scheme`` when set (its density), else
        ``timestep_sampling`` (default logit-normal).
        """
        if o.weighting_scheme is not None:
            return obj.sample_weighting_scheme(o.weighting_scheme, b, generator, logit_mean=o.logit_mean,
                                               logit_std=o.logit_std, mode_scale=o.mode_scale,
                                               device=generator.device)
        if o.timestep_sampling == "uniform":
            return obj.sample_uniform(b, generator, device=generator.device)
        return obj.sample_logit_normal(b, generator, mean=o.logit_mean, std=o.logit_std, device=generator.device)

    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32) -> Prepared:
        """Flow-matching inputs; ``weights`` by ``train.objective.weighting_scheme`` (None: unweighted)."""
        o = objective
        x0 = common.single_frame(latents, self.name).float()
        device = x0.device
        t, noise = draw_image(o, x0, generator, t, noise, family=self.name, sample_t=self.sample_t)
        sigma = obj.shift_timesteps(t, o.shift or float(self._scheduler_config.get("shift", 3.0)))
        inputs = {
            "hidden_states": obj.flow_interpolate(x0, noise, sigma).to(dtype),
            # The pipeline passes the scheduler's timesteps: sigma * 1000.
            "timestep": (sigma * 1000).to(dtype),
            "pooled_projections": text["pooled_prompt_embeds"].to(device=device, dtype=dtype),
            "encoder_hidden_states": text["prompt_embeds"].to(device=device, dtype=dtype),
        }
        return Prepared(inputs, obj.flow_target(x0, noise), obj.weighting_scheme_weights(o.weighting_scheme, sigma),
                        self.loss_mask(mask, x0, o))

    # -- sampling ----------------------------------------------------------------
    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        return {**super().sample_kwargs(cfg), "max_sequence_length": self.max_sequence_length}

    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """Embedding, one layer per joint block, output (``layers.py``)."""
        from diffpipe.families.sd3.layers import sd3_layers

        return sd3_layers(common.unwrap(denoiser))
