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

from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    Lumina2Pipeline,
    Lumina2Transformer2DModel,
)
from transformers import AutoTokenizer, Gemma2Config, Gemma2Model

from diffpipe.config import SampleConfig
from diffpipe.families.lumina2 import flavors
from diffpipe.families.lumina2.layers import lumina2_layers
from diffpipe.models import _common as common
from diffpipe.models import targets
from diffpipe.models.base import Family, Prepared
from diffpipe.models.components import Model, Models, TextBundle, TextPart, one_text_encoder
from diffpipe.models.llm_tokenizers import llm_tokenizer

#: The system prompt ``Lumina2Pipeline`` puts before every prompt.
SYSTEM_PROMPT = (
    "You are an assistant designed to generate superior images with the superior degree of image-text "
    "alignment based on textual prompts or user prompts."
)
MAX_LENGTH = 256  # the pipeline's default max_sequence_length


class Lumina2Family(Family):
    vae_shift = True
    vae_model = Model(AutoencoderKL, flavors.TINY_VAE8)
    models = Models(None, Lumina2Transformer2DModel, FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, flavors)
    text_parts: ClassVar[dict[str, TextPart]] = one_text_encoder(
        AutoTokenizer, lambda: llm_tokenizer(flavors.TINY_LENGTH), Gemma2Model, Gemma2Config, flavors.TINY_GEMMA,
        "lumina2.text_encoder", stream="gemma")
    prompt_tokens = (flavors.TINY_LENGTH, MAX_LENGTH)
    #: diffusers' Lumina2 LoRA example: the attention projections and the
    #: SwiGLU feed-forward of every block (refiners included).
    default_lora_targets: ClassVar[list[str]] = [*targets.attention(), "feed_forward.linear_1", "feed_forward.linear_2", "feed_forward.linear_3"]

    def text_settings(self) -> dict[str, Any]:
        return {**super().text_settings(), "system_prompt": SYSTEM_PROMPT}

    # -- encoding --------------------------------------------------------------
    def caption_prompts(self, captions: list[str]) -> list[str]:
        return [SYSTEM_PROMPT + " <Prompt Start> " + c for c in captions]

    def encode_text(self, encoders: TextBundle, captions: list[str]) -> dict[str, torch.Tensor]:
        # Exactly Lumina2Pipeline.encode_prompt / _get_gemma_prompt_embeds.
        tok = encoders.tokenizer(self.caption_prompts(captions), padding="max_length",
                                 max_length=encoders.max_sequence_length, truncation=True, return_tensors="pt")
        device = next(encoders.text_encoder.parameters()).device
        mask = tok.attention_mask.to(device)
        with torch.no_grad():
            out = encoders.text_encoder(tok.input_ids.to(device), attention_mask=mask, output_hidden_states=True)
        return {"prompt_embeds": out.hidden_states[-2].float(), "prompt_attention_mask": mask.float()}

    # -- training ----------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32) -> Prepared:
        """Flow-matching inputs with Lumina's timestep (0 = noise, 1 = image) and the text mask."""
        f = self.flow_draw(latents, generator, objective, t, noise)
        device = f.x0.device
        inputs = {
            "hidden_states": f.noisy.to(dtype),
            "timestep": (1 - f.sigma).to(dtype),
            "encoder_hidden_states": text["prompt_embeds"].to(device=device, dtype=dtype),
            "encoder_attention_mask": text["prompt_attention_mask"].to(device=device, dtype=torch.long),
        }
        return Prepared(inputs, -f.target, mask=self.loss_mask(mask, f.x0, objective))

    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        return {**super().sample_kwargs(cfg), "max_sequence_length": self.max_sequence_length}

    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """Embedding (with the caption and image refiners), one layer per joint block, output.

        Input tuple ``(noisy, timestep, prompt_embeds, prompt_attention_mask)``; output ``(prediction,)``.
        Prompts of any length mix in a micro-batch: the joint sequence is packed per sample.
        """
        return lumina2_layers(common.unwrap(denoiser))
