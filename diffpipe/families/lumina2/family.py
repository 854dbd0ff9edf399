"""Family ``lumina2``: Lumina Image 2.0 (Unified Next-DiT), Gemma-2 text, flow matching.

Components and names follow ``Lumina2Pipeline``: ``vae`` (AutoencoderKL,
16 channels, factor 8: the pipeline hard-codes the factor, so the tiny VAE
has four levels too), ``text_encoder`` (Gemma2Model: penultimate hidden
states, with the attention mask) + ``tokenizer``, ``transformer``
(Lumina2Transformer2DModel), ``scheduler``. Captions get the pipeline's
system prompt (``<system prompt> <Prompt Start> <caption>``) in the cache
exactly as in sampling. Lumina's time runs the other way (0 = noise, 1 =
image) and the model predicts ``x0 - noise``; the loss uses that convention.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    Lumina2Pipeline,
    Lumina2Transformer2DModel,
)
from transformers import AutoTokenizer, Gemma2Config, Gemma2Model, PreTrainedTokenizerBase

from diffpipe.config import SampleConfig
from diffpipe.families.lumina2.flavors import TINY_GEMMA, TINY_LENGTH, TINY_SCHEDULER, TINY_TRANSFORMER, TINY_VAE8
from diffpipe.models import _common as common
from diffpipe.models._draws import draw_image
from diffpipe.models.base import Family, Prepared
from diffpipe.models.llm_tokenizers import llm_tokenizer
from diffpipe.models.tokenizers import tokenizer_fingerprint
from diffpipe.training import objectives as obj
from diffpipe.utils import digest

#: The system prompt ``Lumina2Pipeline`` puts before every prompt.
SYSTEM_PROMPT = (
    "You are an assistant designed to generate superior images with the superior degree of image-text "
    "alignment based on textual prompts or user prompts."
)
MAX_LENGTH = 256  # the pipeline's default max_sequence_length


@dataclass
class GemmaText:
    tokenizer: PreTrainedTokenizerBase
    text_encoder: Gemma2Model
    max_sequence_length: int

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> GemmaText:
        self.text_encoder.to(device=device, dtype=dtype)
        return self


class Lumina2Family(Family):
    name = "lumina2"
    vae_class = AutoencoderKL
    denoiser_name = "transformer"
    #: diffusers' Lumina2 LoRA example: the attention projections and the
    #: SwiGLU feed-forward of every block (refiners included).
    default_lora_targets: ClassVar[list[str]] = [
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
        "feed_forward.linear_1", "feed_forward.linear_2", "feed_forward.linear_3",
    ]

    @cached_property
    def _vae_config(self) -> dict[str, Any]:
        return dict(TINY_VAE8) if self.cfg.flavor == "tiny" else dict(
            AutoencoderKL.load_config(self.cfg.path, subfolder="vae"))

    @cached_property
    def _scheduler_config(self) -> dict[str, Any]:
        return dict(TINY_SCHEDULER) if self.cfg.flavor == "tiny" else dict(
            FlowMatchEulerDiscreteScheduler.load_config(self.cfg.path, subfolder="scheduler"))

    @property
    def pixel_multiple(self) -> int:
        return 16  # the pipeline's vae_scale_factor (8) x patch size (2)

    @cached_property
    def max_sequence_length(self) -> int:
        """Tokens per prompt: the pipeline's 256, or the tokenizer's limit when lower."""
        if self.cfg.flavor == "tiny":
            return TINY_LENGTH
        return min(int(AutoTokenizer.from_pretrained(self.cfg.path, subfolder="tokenizer").model_max_length),
                   MAX_LENGTH)

    # -- components ------------------------------------------------------------
    def load_vae(self) -> AutoencoderKL:
        return common.component(AutoencoderKL, self.cfg, self.name, "vae", TINY_VAE8)

    def load_tokenizers(self) -> GemmaText:
        if self.cfg.flavor == "tiny":
            return GemmaText(llm_tokenizer(TINY_LENGTH), None, TINY_LENGTH)
        tok = AutoTokenizer.from_pretrained(self.cfg.path, subfolder="tokenizer")
        return GemmaText(tok, None, min(int(tok.model_max_length), MAX_LENGTH))

    def load_text_encoders(self) -> GemmaText:
        enc = self.load_tokenizers()
        if self.cfg.flavor == "tiny":
            tok = enc.tokenizer
            config = Gemma2Config(**TINY_GEMMA, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
            with common.seeded(self.cfg.seed, f"{self.name}.text_encoder"):
                enc.text_encoder = Gemma2Model(config).eval()
        else:
            enc.text_encoder = common.pretrained_text_encoder(Gemma2Model, self.cfg, "text_encoder")
        return enc

    def load_denoiser(self) -> Lumina2Transformer2DModel:
        return common.component(Lumina2Transformer2DModel, self.cfg, self.name, "transformer", TINY_TRANSFORMER)

    def inference_scheduler(self) -> FlowMatchEulerDiscreteScheduler:
        return FlowMatchEulerDiscreteScheduler.from_config(self._scheduler_config)

    def load_pipeline(self) -> Lumina2Pipeline:
        enc = self.load_text_encoders()
        return Lumina2Pipeline(transformer=self.load_denoiser(), scheduler=self.inference_scheduler(),
                               vae=self.load_vae(), text_encoder=enc.text_encoder, tokenizer=enc.tokenizer)

    @property
    def pipeline_class(self) -> type:
        return Lumina2Pipeline

    # -- identities ------------------------------------------------------------
    def encoders_identity(self) -> str:
        if self.cfg.flavor == "tiny":
            return common.memo_identity((self.name, self.cfg.seed, "text"),
                                        lambda: self._text_identity(self.load_text_encoders()))
        return digest({
            "tokenizer": tokenizer_fingerprint(self.load_tokenizers().tokenizer),
            "text_encoder": common.transformers_folder_identity(Gemma2Model, Gemma2Config, self.cfg.path,
                                                                "text_encoder", variant=self.cfg.weight_variant),
            "max_sequence_length": self.max_sequence_length, "system_prompt": SYSTEM_PROMPT,
        })

    @staticmethod
    def _text_identity(enc: GemmaText) -> str:
        return digest({"tokenizer": tokenizer_fingerprint(enc.tokenizer),
                       "text_encoder": common.module_identity(enc.text_encoder),
                       "max_sequence_length": enc.max_sequence_length, "system_prompt": SYSTEM_PROMPT})

    # -- encoding --------------------------------------------------------------
    def encode_pixels(self, vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        frames = pixels.shape[2]
        param = next(vae.parameters())
        with torch.no_grad():
            x = common.frames_to_batch(pixels).to(device=param.device, dtype=param.dtype)
            latents = vae.encode(x).latent_dist.mode()
        latents = (latents.float() - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor
        return common.batch_to_frames(latents, frames)

    @staticmethod
    def _prompts(captions: list[str]) -> list[str]:
        return [SYSTEM_PROMPT + " <Prompt Start> " + c for c in captions]

    def encode_text(self, encoders: GemmaText, captions: list[str]) -> dict[str, torch.Tensor]:
        # Exactly Lumina2Pipeline.encode_prompt / _get_gemma_prompt_embeds.
        tok = encoders.tokenizer(self._prompts(captions), padding="max_length",
                                 max_length=encoders.max_sequence_length, truncation=True, return_tensors="pt")
        device = next(encoders.text_encoder.parameters()).device
        mask = tok.attention_mask.to(device)
        with torch.no_grad():
            out = encoders.text_encoder(tok.input_ids.to(device), attention_mask=mask, output_hidden_states=True)
        return {"prompt_embeds": out.hidden_states[-2].float(), "prompt_attention_mask": mask.float()}

    def token_limits(self, encoders: GemmaText) -> dict[str, int]:
        return {"gemma": encoders.max_sequence_length}

    def count_tokens(self, encoders: GemmaText, captions: list[str]) -> dict[str, list[int]]:
        return {"gemma": [len(x) for x in encoders.tokenizer(self._prompts(list(captions))).input_ids]}

    # -- training ----------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32) -> Prepared:
        """Flow-matching inputs with Lumina's timestep (0 = noise, 1 = image) and the text mask.

        The target is ``x0 - noise``: the pipeline steps with ``-pred`` as the velocity ``noise - x0``.
        """
        o = objective
        x0 = common.single_frame(latents, self.name).float()
        device = x0.device
        t, noise = draw_image(o, x0, generator, t, noise, family=self.name)
        sigma = obj.shift_timesteps(t, o.shift or float(self._scheduler_config.get("shift", 1.0)))
        inputs = {
            "hidden_states": obj.flow_interpolate(x0, noise, sigma).to(dtype),
            "timestep": (1 - sigma).to(dtype),
            "encoder_hidden_states": text["prompt_embeds"].to(device=device, dtype=dtype),
            "encoder_attention_mask": text["prompt_attention_mask"].to(device=device, dtype=torch.long),
        }
        return Prepared(inputs, -obj.flow_target(x0, noise), mask=self.loss_mask(mask, x0, o))

    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        return {**super().sample_kwargs(cfg), "max_sequence_length": self.max_sequence_length}

    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """Embedding (with the caption and image refiners), one layer per joint block, output.

        Input tuple ``(noisy, timestep, prompt_embeds, prompt_attention_mask)``; output ``(prediction,)``.
        Prompts of any length mix in a micro-batch: the joint sequence is packed per sample.
        """
        from diffpipe.families.lumina2.layers import lumina2_layers

        return lumina2_layers(common.unwrap(denoiser))
