"""Family ``auraflow``: AuraFlow, flow matching on SDXL-VAE latents, UMT5 captions.

Components and names follow ``AuraFlowPipeline``: ``vae`` (AutoencoderKL; latents times
``scaling_factor``), ``text_encoder`` (UMT5EncoderModel) + ``tokenizer``, ``transformer``
(AuraFlowTransformer2DModel, which patchifies itself), ``scheduler`` (FlowMatchEulerDiscreteScheduler).
Captions are encoded by the pipeline's own ``encode_prompt`` (states zeroed past each caption). At noise
level ``sigma`` the transformer sees ``(1 - sigma) x0 + sigma noise`` and the timestep ``sigma`` itself
(the pipeline passes ``t / 1000``), and predicts ``noise - x0``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from diffusers import AuraFlowPipeline, AuraFlowTransformer2DModel, AutoencoderKL, FlowMatchEulerDiscreteScheduler
from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

from diffpipe.config import SampleConfig
from diffpipe.families.auraflow import flavors
from diffpipe.models import _common as common
from diffpipe.models import targets
from diffpipe.models.base import Family, Prepared
from diffpipe.models.components import Models, TextBundle, TextPart, one_text_encoder
from diffpipe.models.tokenizers import t5_tokenizer

MAX_LENGTH = 256  # AuraFlowPipeline's default max_sequence_length


class AuraFlowFamily(Family):
    models = Models(AutoencoderKL, AuraFlowTransformer2DModel, FlowMatchEulerDiscreteScheduler, AuraFlowPipeline,
                    flavors)
    text_parts: ClassVar[dict[str, TextPart]] = one_text_encoder(
        AutoTokenizer, lambda: t5_tokenizer(flavors.TINY_LENGTH), UMT5EncoderModel, UMT5Config, flavors.TINY_UMT5,
        "auraflow.text_encoder", common.T5_IDS, stream="umt5")
    prompt_tokens = (flavors.TINY_LENGTH, MAX_LENGTH)
    #: Attention of both streams (joint blocks) and of the single blocks, and their feed-forwards.
    default_lora_targets: ClassVar[list[str]] = [*targets.attention(), *targets.added_projections(), "ff.linear_1", "ff.linear_2", "ff.out_projection"]

    # -- encoding --------------------------------------------------------------
    def encode_text(self, encoders: TextBundle, captions: list[str]) -> dict[str, torch.Tensor]:
        embeds, _, _, _ = self.pipeline_prompt(encoders, captions)
        return {"prompt_embeds": embeds.float()}

    # -- training ----------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32) -> Prepared:
        """Noisy latents, the caption states and the timestep ``sigma``; the target ``noise - x0``."""
        f = self.flow_draw(latents, generator, objective, t, noise)
        inputs = {
            "hidden_states": f.noisy.to(dtype),
            "encoder_hidden_states": text["prompt_embeds"].to(device=f.x0.device, dtype=dtype),
            "timestep": f.sigma.to(dtype),
        }
        return self.flow_prepared(f, inputs, mask, objective)

    # -- sampling ----------------------------------------------------------------
    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        return {**super().sample_kwargs(cfg), "max_sequence_length": self.max_sequence_length}
