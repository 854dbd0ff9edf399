"""Family ``mochi``: Mochi 1 text-to-video (asymmetric DiT), flow matching, T5.

Components and names follow ``MochiPipeline``: ``vae`` (AutoencoderKLMochi:
8x spatial and 6x temporal compression, 12 latent channels, so clips have
``6k+1`` frames; latents normalised by the config's ``latents_mean`` /
``latents_std`` and ``scaling_factor``, the inverse of the pipeline's
decode), ``text_encoder`` (T5EncoderModel given the padding mask; the mask is
cached as ``prompt_attention_mask``) + ``tokenizer``, ``transformer``
(MochiTransformer3DModel), ``scheduler`` (FlowMatchEulerDiscreteScheduler
with ``invert_sigmas``). Mochi runs time the other way: at noise level
``sigma`` (``x_t = (1 - sigma) x0 + sigma noise``) the transformer is fed
``timestep = (1 - sigma) * 1000`` and predicts ``x0 - noise``, which is what
the pipeline's inverted-sigma Euler steps integrate. Training shifts ``t`` by
the scheduler's ``shift`` (1 for Mochi 1). Clips are resampled to 30 fps
(Mochi 1's rate).

``MochiPipeline`` assumes Mochi 1's geometry (8x, 6x, 2x2 patches, 12
channels), so the tiny flavor keeps it. Default LoRA targets: the block
attention of both streams (``attn1.to_q``, ``attn1.to_k``, ``attn1.to_v``,
``attn1.to_out.0``, ``attn1.add_q_proj``, ``attn1.add_k_proj``,
``attn1.add_v_proj``, ``attn1.to_add_out``) and the feed-forward linears
(``ff.net.0.proj``, ``ff.net.2``, ``ff_context.net.0.proj``,
``ff_context.net.2``); the caption pooler's attention is left alone.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from diffusers import AutoencoderKLMochi, FlowMatchEulerDiscreteScheduler, MochiPipeline, MochiTransformer3DModel

from diffpipe.config import SampleConfig
from diffpipe.families.mochi import flavors
from diffpipe.families.mochi.layers import mochi_layers
from diffpipe.models import _common as common
from diffpipe.models import _video as video
from diffpipe.models import objectives as obj
from diffpipe.models import targets
from diffpipe.models.base import Family, Prepared
from diffpipe.models.components import Models

MAX_LENGTH = 256  # MochiPipeline's default max_sequence_length
SPATIAL, TEMPORAL, PATCH = 8, 6, 2  # what MochiPipeline assumes


class MochiFamily(video.T5TextFamily, Family):
    prompt_tokens = (video.TINY_LENGTH, MAX_LENGTH)
    models = Models(AutoencoderKLMochi, MochiTransformer3DModel, FlowMatchEulerDiscreteScheduler, MochiPipeline,
                    flavors)
    is_video = True
    fps = 30.0
    frame_rule = (TEMPORAL, 1)
    default_lora_targets: ClassVar[list[str]] = targets.dual_stream("attn1")

    @property
    def pixel_multiple(self) -> int:
        return SPATIAL * PATCH

    @property
    def flow_shift(self) -> float:
        return float(self._scheduler_config.get("shift", 1.0))

    # -- components --------------------------------------------------------------

    # -- encoding ------------------------------------------------------------------
    def encode_pixels(self, vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        latents = common.vae_latents(vae, pixels, per_frame=False)
        c = vae.config
        if c.latents_mean is None or c.latents_std is None:
            return latents * c.scaling_factor
        mean, std = common.latent_stats(vae, latents)
        # Inverse of MochiPipeline's decode: ``latents * std / scaling_factor + mean``.
        return (latents - mean) * c.scaling_factor / std

    def encode_text(self, encoders: video.T5Text, captions: list[str]) -> dict[str, torch.Tensor]:
        embeds, mask = video.t5_embeds(encoders, captions, masked_encoder=True)
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask}

    # -- training ------------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32) -> Prepared:
        """Flow-matching inputs with Mochi's timestep ``(1 - sigma) * 1000`` and the boolean text mask;
        the target is ``x0 - noise``."""
        o = objective
        x0 = video.check_video_latents(latents, self.name)
        t, noise = video.draw(o, x0, generator, t, noise)
        sigma = obj.shift_timesteps(t, o.shift or self.flow_shift)
        device = x0.device
        inputs = {
            "hidden_states": obj.flow_interpolate(x0, noise, sigma).to(dtype),
            "timestep": ((1 - sigma) * self._scheduler_config.get("num_train_timesteps", 1000)).to(dtype),
            "encoder_hidden_states": text["prompt_embeds"].to(device=device, dtype=dtype),
            "encoder_attention_mask": text["prompt_attention_mask"].to(device=device).bool(),
        }
        return Prepared(inputs, -obj.flow_target(x0, noise), mask=self.loss_mask(mask, x0, o))

    # -- sampling ------------------------------------------------------------------
    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        return {
            **super().sample_kwargs(cfg),
            "max_sequence_length": self.load_tokenizers().max_sequence_length,
        }

    # -- pipeline parallelism ---------------------------------------------------------
    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """Embedding, one layer per block, output (``layers.py``).

        Input tuple ``(noisy, (1 - sigma) * 1000, prompt_embeds, mask (bool))``; output ``(prediction,)``.
        """
        return mochi_layers(common.unwrap(denoiser))
