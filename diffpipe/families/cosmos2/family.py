"""Family ``cosmos2``: Cosmos-Predict2 text-to-image (2B and 14B DiT), T5 text, a Wan video VAE.

Components and names follow ``Cosmos2TextToImagePipeline``: ``vae``
(AutoencoderKLWan: 5-D latents ``[B, 16, 1, h, w]``, normalised by per-channel
``latents_mean`` / ``latents_std`` and ``sigma_data = 1`` as the pipeline
decodes), ``text_encoder`` (T5EncoderModel: last hidden states, zeros past
each prompt, 512 tokens) + ``tokenizer``, ``transformer``
(CosmosTransformer3DModel), ``scheduler`` (Karras sigmas from 80 to 0.002),
``safety_checker``.

Training objective, as Cosmos-Predict2 trains and as the pipeline samples.
The pipeline runs in EDM noise levels ``sigma``: ``x = x0 + sigma eps``, and
preconditions with ``t = sigma / (sigma + 1)``: the transformer reads
``c_in x = (1 - t) x0 + t eps`` at timestep ``t`` and its output ``F``
gives the denoised ``D = c_skip x + c_out F`` (``c_skip = 1 - t``,
``c_out = -t``). Cosmos-Predict2 trains ``D`` on ``x0`` with weight
``(sigma^2 + 1) / sigma^2`` and ``log sigma ~ N(0, 1)``. Written in ``t``
this is rectified flow: ``log sigma ~ N(m, s)`` is ``t ~ logit-normal(m, s)``
(``train.objective.logit_mean`` / ``logit_std``, defaults 0 and 1), and
``D - x0 = t (eps - x0 - F)``, so the loss is ``w(t) |F - (eps - x0)|^2``
with ``w(t) = t^2 + (1 - t)^2``. The loss is computed in that form (no
division by tiny sigmas); a test checks it equals the pipeline's
preconditioned one.

The safety checker. The stock pipeline builds ``cosmos_guardrail``'s
``CosmosSafetyChecker`` when given none; that package downloads its own
models at run time and cannot run offline. The tiny flavor (random weights,
tests) passes :class:`PassThroughSafetyChecker` explicitly for that one
component; the local flavor (real weights) uses the real checker and
needs ``pip install cosmos_guardrail``.

LoRA loading. diffusers 0.42.1's ``Cosmos2TextToImagePipeline`` has no LoRA
loader; diffusers' own ``CosmosLoraLoaderMixin`` (written for Cosmos 2.5)
loads into any pipeline's ``transformer``. :class:`Cosmos2TextToImagePipeline`
here is the stock pipeline with that mixin and nothing else; it keeps the
stock name, so a saved (merged) pipeline's ``model_index.json`` names the
stock class. With the stock class alone, ``pipe.transformer.load_lora_adapter(
file, prefix="transformer", use_safetensors=True)`` loads our diffusers-format
export (without ``use_safetensors`` the header holding alpha is not read).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from diffusers import AutoencoderKLWan, CosmosTransformer3DModel, FlowMatchEulerDiscreteScheduler
from diffusers import Cosmos2TextToImagePipeline as StockCosmos2TextToImagePipeline
from diffusers.loaders import CosmosLoraLoaderMixin
from diffusers.utils import is_cosmos_guardrail_available, is_torchvision_available

from diffpipe.config import SampleConfig
from diffpipe.families.cosmos2 import flavors
from diffpipe.families.cosmos2.layers import cosmos_layers
from diffpipe.models import _common as common
from diffpipe.models import _video as video
from diffpipe.models import objectives as obj
from diffpipe.models import targets
from diffpipe.models._draws import draw_image
from diffpipe.models._video import T5Text
from diffpipe.models.base import Family, Prepared
from diffpipe.models.components import Models

MAX_LENGTH = 512  # the pipeline's max_sequence_length
SIGMA_DATA = 1.0  # the pipeline's (fixed) sigma_data


class PassThroughSafetyChecker:
    """Stand-in for ``cosmos_guardrail.CosmosSafetyChecker``, for the tiny flavor only.

    The pipeline calls ``to``, ``check_text_safety`` and ``check_video_safety``; this one
    lets every prompt and image through unchanged. Real Cosmos weights get the real
    checker (install ``cosmos_guardrail``).
    """

    def to(self, *args: Any, **kwargs: Any) -> PassThroughSafetyChecker:
        return self

    def check_text_safety(self, prompt: str) -> bool:
        return True

    def check_video_safety(self, frames: np.ndarray) -> np.ndarray:
        return frames


class Cosmos2TextToImagePipeline(StockCosmos2TextToImagePipeline, CosmosLoraLoaderMixin):
    """diffusers' ``Cosmos2TextToImagePipeline`` with diffusers' ``CosmosLoraLoaderMixin``.

    Same class name on purpose: ``save_pretrained`` writes it into ``model_index.json``,
    which then loads with the stock class.
    """


def edm_weight(t: torch.Tensor) -> torch.Tensor:
    """Cosmos-Predict2's loss weight ``(sigma^2 + 1) / sigma^2`` on ``x0``, in velocity units: ``t^2 + (1-t)^2``."""
    return t.float() ** 2 + (1 - t.float()) ** 2


class Cosmos2Family(video.T5TextFamily, Family):
    prompt_tokens = (flavors.TINY_LENGTH, MAX_LENGTH)
    models = Models(AutoencoderKLWan, CosmosTransformer3DModel, None, Cosmos2TextToImagePipeline, flavors)
    min_pixel_multiple = 16  # the pipeline refuses sides not divisible by 16
    #: Cosmos-Predict2's own LoRA targets (``q_proj, k_proj, v_proj, output_proj,
    #: mlp.layer1, mlp.layer2``) in diffusers names: self- and cross-attention
    #: projections and the feed-forward of every block.
    default_lora_targets: ClassVar[list[str]] = [*targets.attention("attn1"), *targets.attention("attn2"), *targets.feed_forward()]

    # -- components ------------------------------------------------------------

    def inference_scheduler(self) -> FlowMatchEulerDiscreteScheduler:
        if self.cfg.flavor == "tiny":
            return FlowMatchEulerDiscreteScheduler(**flavors.TINY_SCHEDULER)
        return FlowMatchEulerDiscreteScheduler.from_pretrained(self.cfg.path, subfolder="scheduler")

    def safety_checker(self) -> PassThroughSafetyChecker | None:
        """The pipeline's ``safety_checker``: the stand-in for the tiny flavor; None (the pipeline
        builds cosmos_guardrail's checker) for real weights, which need ``cosmos_guardrail``."""
        if self.cfg.flavor == "tiny":
            return PassThroughSafetyChecker()
        if not is_cosmos_guardrail_available():
            raise ValueError(
                f"model.path {self.cfg.path}: Cosmos2TextToImagePipeline runs NVIDIA's safety "
                "checker, which needs the cosmos_guardrail package: pip install cosmos_guardrail"
            )
        return None

    def load_pipeline(self) -> Cosmos2TextToImagePipeline:
        """The stock pipeline from the declared parts, with the family's safety checker stand-in."""
        text = self.load_text_encoders()
        return self.pipeline_class(vae=self.load_vae(), transformer=self.load_denoiser(),
                                   scheduler=self.inference_scheduler(), safety_checker=self.safety_checker(),
                                   **text.parts)

    # -- identities ------------------------------------------------------------
    # -- encoding --------------------------------------------------------------
    def encode_pixels(self, vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        # Each frame is an image of its own, through the VAE's frame axis. Inverse of the pipeline's
        # decode: ``latents * std / sigma_data + mean``.
        latents = common.vae_latents(vae, pixels, frame_axis=True)
        mean, std = common.latent_stats(vae, latents)
        return (latents - mean) / std * SIGMA_DATA

    def encode_text(self, encoders: T5Text, captions: list[str]) -> dict[str, torch.Tensor]:
        # Exactly Cosmos2TextToImagePipeline._get_t5_prompt_embeds: zeros past each prompt's tokens.
        embeds, mask = video.t5_embeds(encoders, captions, masked_encoder=True)
        return {"prompt_embeds": embeds * mask[..., None]}

    # -- training ----------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32) -> Prepared:
        """``c_in x`` (``[B,C,1,h,w]``: the transformer reads 5-D) at ``t = sigma / (sigma + 1)``, the text,
        the pipeline's all-zero padding mask; EDM ``weights``."""
        o = objective
        x0 = common.single_frame(latents, self.name).float()
        # Logit-normal t is log-normal sigma: Cosmos-Predict2's sample_sigma at (0, 1).
        t, noise = draw_image(o, x0, generator, t, noise, family=self.name)
        x0, noise = x0[:, :, None], noise[:, :, None]
        if o.shift:
            t = obj.shift_timesteps(t, o.shift)
        inputs = {
            "hidden_states": obj.flow_interpolate(x0, noise, t).to(dtype),
            "timestep": t.to(dtype),
            "encoder_hidden_states": text["prompt_embeds"].to(device=x0.device, dtype=dtype),
            "padding_mask": x0.new_zeros(1, 1, *x0.shape[-2:], dtype=dtype),
        }
        return Prepared(inputs, obj.flow_target(x0, noise), edm_weight(t), self.loss_mask(mask, x0, o))

    def predict(self, denoiser: torch.nn.Module, prepared: Prepared) -> torch.Tensor:
        """The transformer's output ``F``; a clear error where it needs torchvision and it is missing."""
        if common.unwrap(denoiser).config.concat_padding_mask and not is_torchvision_available():
            raise RuntimeError(
                "CosmosTransformer3DModel (concat_padding_mask: true, as Cosmos-Predict2) resizes "
                "its padding mask with torchvision: pip install torchvision (the build matching torch)"
            )
        return super().predict(denoiser, prepared)

    # -- sampling ----------------------------------------------------------------
    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        return {**super().sample_kwargs(cfg), "max_sequence_length": self.max_sequence_length}

    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """Embedding, one layer per block, output (``layers.py``).

        Input tuple ``(noisy [B,C,1,h,w], t, prompt_embeds, padding_mask [1,1,h,w])``; output
        ``(prediction,)``.
        """
        return cosmos_layers(common.unwrap(denoiser))
