"""Family ``auraflow``: AuraFlow, flow matching on SDXL-VAE latents, UMT5 captions.

Components and names follow ``AuraFlowPipeline``: ``vae`` (AutoencoderKL; latents times
``scaling_factor``), ``text_encoder`` (UMT5EncoderModel) + ``tokenizer``, ``transformer``
(AuraFlowTransformer2DModel, which patchifies itself), ``scheduler`` (FlowMatchEulerDiscreteScheduler).
Captions are encoded by the pipeline's own ``encode_prompt`` (states zeroed past each caption). At noise
level ``sigma`` the transformer sees ``(1 - sigma) x0 + sigma noise`` and the timestep ``sigma`` itself
(the pipeline passes ``t / 1000``), and predicts ``noise - x0``.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, ClassVar

import torch
from diffusers import AuraFlowPipeline, AuraFlowTransformer2DModel, AutoencoderKL, FlowMatchEulerDiscreteScheduler
from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

from diffpipe.config import SampleConfig
from diffpipe.families.auraflow.flavors import TINY_LENGTH, TINY_SCHEDULER, TINY_TRANSFORMER, TINY_UMT5, TINY_VAE
from diffpipe.models import _common as common
from diffpipe.models.base import Family, Prepared
from diffpipe.models.components import Model, TextBundle, TextEncoder, TextPart, Tokenizer
from diffpipe.models.tokenizers import t5_tokenizer
from diffpipe.training import objectives as obj

MAX_LENGTH = 256  # AuraFlowPipeline's default max_sequence_length


class AuraFlowFamily(Family):
    name = "auraflow"
    token_streams: ClassVar[dict[str, tuple[str, str]]] = {"umt5": ("tokenizer", "sequence")}
    vae_model = Model(AutoencoderKL, TINY_VAE)
    denoiser_model = Model(AuraFlowTransformer2DModel, TINY_TRANSFORMER)
    scheduler_model = Model(FlowMatchEulerDiscreteScheduler, TINY_SCHEDULER)
    text_parts: ClassVar[dict[str, TextPart]] = {
        "tokenizer": Tokenizer(AutoTokenizer, lambda: t5_tokenizer(TINY_LENGTH)),
        "text_encoder": TextEncoder(UMT5EncoderModel, UMT5Config, common.tiny_text_model(
            UMT5EncoderModel, UMT5Config, TINY_UMT5, "auraflow.text_encoder", common.T5_IDS)),
    }
    denoiser_name = "transformer"
    #: Attention of both streams (joint blocks) and of the single blocks, and their feed-forwards.
    default_lora_targets: ClassVar[list[str]] = [
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
        "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
        "ff.linear_1", "ff.linear_2", "ff.out_projection",
    ]

    @cached_property
    def max_sequence_length(self) -> int:
        return self.prompt_length(TINY_LENGTH, MAX_LENGTH)

    def text_settings(self) -> dict[str, Any]:
        return {"max_sequence_length": self.max_sequence_length}

    @property
    def pixel_multiple(self) -> int:
        vae = 2 ** (len(self._vae_config["block_out_channels"]) - 1)
        return vae * int(self._denoiser_config.get("patch_size", 2))

    @property
    def pipeline_class(self) -> type:
        return AuraFlowPipeline

    # -- encoding --------------------------------------------------------------
    def encode_text(self, encoders: TextBundle, captions: list[str]) -> dict[str, torch.Tensor]:
        pipe = self.text_pipeline(encoders)
        device = next(encoders.text_encoder.parameters()).device
        with torch.no_grad():
            embeds, _, _, _ = pipe.encode_prompt(list(captions), do_classifier_free_guidance=False, device=device,
                                                 max_sequence_length=encoders.max_sequence_length)
        return {"prompt_embeds": embeds.float()}

    # -- training ----------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32) -> Prepared:
        """Noisy latents, the caption states and the timestep ``sigma``; the target ``noise - x0``."""
        o = objective
        x0, noise, sigma = self.draw_flow(latents, generator, o, t, noise)
        inputs = {
            "hidden_states": obj.flow_interpolate(x0, noise, sigma).to(dtype),
            "encoder_hidden_states": text["prompt_embeds"].to(device=x0.device, dtype=dtype),
            "timestep": sigma.to(dtype),
        }
        return Prepared(inputs, obj.flow_target(x0, noise), mask=self.loss_mask(mask, x0, o))

    # -- sampling ----------------------------------------------------------------
    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        return {**super().sample_kwargs(cfg), "max_sequence_length": self.max_sequence_length}
