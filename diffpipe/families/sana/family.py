"""Family ``sana``: Sana, a linear-attention DiT on deep-compression autoencoder latents, Gemma-2 text.

Components and names follow ``SanaPipeline``: ``vae`` (AutoencoderDC; latents times ``scaling_factor``,
the inverse of the pipeline's decode), ``text_encoder`` (Gemma2Model) + ``tokenizer``, ``transformer``
(SanaTransformer2DModel), ``scheduler`` (DPM-Solver on flow sigmas). Captions are encoded by the pipeline's
own ``encode_prompt`` on a pipeline of the text components (its instruction prefix included, the last
``max_sequence_length`` tokens kept), so the cache equals what sampling computes. Flow matching: at noise
level ``sigma`` the transformer sees ``(1 - sigma) x0 + sigma noise`` and the timestep
``sigma * 1000 * timestep_scale``, and predicts ``noise - x0`` (``flow_prediction``).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, ClassVar

import torch
from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel
from transformers import AutoTokenizer, Gemma2Config, Gemma2Model

from diffpipe.config import SampleConfig
from diffpipe.families.sana.flavors import TINY_GEMMA, TINY_LENGTH, TINY_SCHEDULER, TINY_TRANSFORMER, TINY_VAE
from diffpipe.models import _common as common
from diffpipe.models.base import Family, Prepared
from diffpipe.models.components import Model, TextBundle, TextEncoder, TextPart, Tokenizer
from diffpipe.models.llm_tokenizers import llm_tokenizer
from diffpipe.training import objectives as obj

MAX_LENGTH = 300  # SanaPipeline's default max_sequence_length


class SanaFamily(Family):
    name = "sana"
    token_streams: ClassVar[dict[str, tuple[str, str]]] = {"gemma": ("tokenizer", "sequence")}
    vae_model = Model(AutoencoderDC, TINY_VAE)
    denoiser_model = Model(SanaTransformer2DModel, TINY_TRANSFORMER)
    scheduler_model = Model(DPMSolverMultistepScheduler, TINY_SCHEDULER)
    text_parts: ClassVar[dict[str, TextPart]] = {
        "tokenizer": Tokenizer(AutoTokenizer, lambda: llm_tokenizer(TINY_LENGTH)),
        "text_encoder": TextEncoder(Gemma2Model, Gemma2Config,
                                    common.tiny_text_model(Gemma2Model, Gemma2Config, TINY_GEMMA, "sana.text_encoder")),
    }
    denoiser_name = "transformer"
    #: Self and cross attention of every block and the 1x1 convolutions of its Mix-FFN.
    default_lora_targets: ClassVar[list[str]] = [
        "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
        "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
        "ff.conv_inverted", "ff.conv_point",
    ]

    @cached_property
    def max_sequence_length(self) -> int:
        """Caption tokens kept: the pipeline's 300, or the tokenizer's limit when lower."""
        return self.prompt_length(TINY_LENGTH, MAX_LENGTH)

    def text_settings(self) -> dict[str, Any]:
        return {"max_sequence_length": self.max_sequence_length}

    @property
    def vae_factor(self) -> int:
        return 2 ** (len(self._vae_config["encoder_block_out_channels"]) - 1)

    @property
    def pixel_multiple(self) -> int:
        return self.vae_factor * int(self._denoiser_config.get("patch_size", 1))

    def shift_for(self, x0: torch.Tensor) -> float:
        return float(self._scheduler_config.get("flow_shift", 1.0))  # the DPM-Solver scheduler's flow shift

    @property
    def pipeline_class(self) -> type:
        return SanaPipeline

    # -- encoding --------------------------------------------------------------
    def encode_text(self, encoders: TextBundle, captions: list[str]) -> dict[str, torch.Tensor]:
        pipe = self.text_pipeline(encoders)
        device = next(encoders.text_encoder.parameters()).device
        with torch.no_grad():
            embeds, mask, _, _ = pipe.encode_prompt(list(captions), do_classifier_free_guidance=False, device=device,
                                                    max_sequence_length=encoders.max_sequence_length)
        return {"prompt_embeds": embeds.float(), "prompt_attention_mask": mask.float()}

    # -- training ----------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32) -> Prepared:
        """Noisy latents, the flow timestep, the caption states and mask; the target ``noise - x0``."""
        o = objective
        x0, noise, sigma = self.draw_flow(latents, generator, o, t, noise)
        device = x0.device
        scale = float(self._denoiser_config.get("timestep_scale", 1.0))
        inputs = {
            "hidden_states": obj.flow_interpolate(x0, noise, sigma).to(dtype),
            "encoder_hidden_states": text["prompt_embeds"].to(device=device, dtype=dtype),
            "encoder_attention_mask": text["prompt_attention_mask"].to(device=device),
            "timestep": (sigma * self._scheduler_config.get("num_train_timesteps", 1000) * scale).to(dtype),
        }
        return Prepared(inputs, obj.flow_target(x0, noise), mask=self.loss_mask(mask, x0, o))

    # -- sampling ----------------------------------------------------------------
    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        return {**super().sample_kwargs(cfg), "max_sequence_length": self.max_sequence_length}
