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

from typing import Any, ClassVar

import torch
from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel
from transformers import AutoTokenizer, Gemma2Config, Gemma2Model

from diffpipe.config import SampleConfig
from diffpipe.families.sana import flavors
from diffpipe.models import targets
from diffpipe.models.base import Family, Prepared
from diffpipe.models.components import Models, TextBundle, TextPart, one_text_encoder
from diffpipe.models.llm_tokenizers import llm_tokenizer

MAX_LENGTH = 300  # SanaPipeline's default max_sequence_length


class SanaFamily(Family):
    models = Models(AutoencoderDC, SanaTransformer2DModel, DPMSolverMultistepScheduler, SanaPipeline, flavors)
    text_parts: ClassVar[dict[str, TextPart]] = one_text_encoder(
        AutoTokenizer, lambda: llm_tokenizer(flavors.TINY_LENGTH), Gemma2Model, Gemma2Config, flavors.TINY_GEMMA,
        "sana.text_encoder", stream="gemma")
    prompt_tokens = (flavors.TINY_LENGTH, MAX_LENGTH)
    #: Self and cross attention of every block and the 1x1 convolutions of its Mix-FFN.
    default_lora_targets: ClassVar[list[str]] = [*targets.attention("attn1"), *targets.attention("attn2"), "ff.conv_inverted", "ff.conv_point"]

    def shift_for(self, x0: torch.Tensor) -> float:
        return float(self._scheduler_config.get("flow_shift", 1.0))  # the DPM-Solver scheduler's flow shift

    # -- encoding --------------------------------------------------------------
    def encode_text(self, encoders: TextBundle, captions: list[str]) -> dict[str, torch.Tensor]:
        embeds, mask, _, _ = self.pipeline_prompt(encoders, captions)
        return {"prompt_embeds": embeds.float(), "prompt_attention_mask": mask.float()}

    # -- training ----------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32) -> Prepared:
        """Noisy latents, the flow timestep, the caption states and mask; the target ``noise - x0``."""
        f = self.flow_draw(latents, generator, objective, t, noise)
        device = f.x0.device
        scale = float(self._denoiser_config.get("timestep_scale", 1.0))
        inputs = {
            "hidden_states": f.noisy.to(dtype),
            "encoder_hidden_states": text["prompt_embeds"].to(device=device, dtype=dtype),
            "encoder_attention_mask": text["prompt_attention_mask"].to(device=device),
            "timestep": (f.sigma * self._scheduler_config.get("num_train_timesteps", 1000) * scale).to(dtype),
        }
        return self.flow_prepared(f, inputs, mask, objective)

    # -- sampling ----------------------------------------------------------------
    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        return {**super().sample_kwargs(cfg), "max_sequence_length": self.max_sequence_length}
