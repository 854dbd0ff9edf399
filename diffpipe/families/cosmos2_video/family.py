"""Family ``cosmos2-video``: Cosmos-Predict2 Video2World (2B and 14B DiT), clips continued from their first frames.

Components and names follow ``Cosmos2VideoToWorldPipeline`` and are those of
``cosmos2`` (:mod:`diffpipe.families.cosmos2.family`: Wan VAE, T5 text, the Cosmos
transformer, the safety checker), with two differences: the transformer reads
one more input channel (the condition mask: 17 = 16 latent + 1), and clips
go through the causal VAE whole (``[B, 16, (F - 1) / 4 + 1, h, w]``), so
clips have ``4k + 1`` frames; they are resampled to 16 fps (the pipeline
generates 93 frames at 16 fps: 24 latent frames).

Conditioning, as ``prepare_latents`` and the denoising loop build it. The
pipeline encodes the conditioning frames (an image, or the first frames of a
video), padded to the clip length by repeating the last one, and marks the
first ``k = (frames - 1) // 4 + 1`` latent frames as given: on those frames
the transformer reads the clean conditioning latents (not ``c_in x``) at the
timestep of ``sigma_conditioning = 1e-4``, a condition-mask channel of ones,
and its output there is replaced by the conditioning latents. The VAE is
causal: latent frame ``j`` depends only on pixel frames up to ``4j``, so the
first ``k`` latent frames of a cached clip are exactly the pipeline's
conditioning latents for that clip's first ``4(k - 1) + 1`` frames. Training
therefore needs no separate conditioning cache: the clip's own latents are the
conditioning (a test checks this against the stock ``prepare_latents``).
``k`` is drawn per clip from {1, 2} as Cosmos-Predict2 trains (one image or
five frames); evaluation at fixed timesteps uses ``k = 1``, the image-to-video
case; single-frame items (images) train unconditioned.

Loss. Cosmos-Predict2's EDM objective as in ``cosmos2`` (velocity form,
weight ``t^2 + (1 - t)^2``, ``log sigma ~ N(0, 1)`` = ``t ~ logit-normal``),
with its video noise adjustment: sigma is multiplied by ``sqrt(T)`` for clips
of ``T`` latent frames, which is the timestep shift ``s = sqrt(T)`` (``s
sigma / (1 + s sigma)``; ``train.objective.shift`` overrides it). On the
conditioned frames the denoised output is the clean latent, so their error is
zero and they add nothing (the per-sample mean still counts them, as
Cosmos-Predict2 reduces).

LoRA loading. diffusers' ``Cosmos2VideoToWorldPipeline`` has no LoRA loader;
:class:`Cosmos2VideoToWorldPipeline` here adds diffusers' ``CosmosLoraLoaderMixin``
and keeps the stock name (see ``cosmos2``). Sampling needs ``sample.images``
(the first frame of each clip).
"""

from __future__ import annotations

import math
from functools import cached_property
from typing import Any

import torch
from diffusers import Cosmos2VideoToWorldPipeline as StockCosmos2VideoToWorldPipeline
from diffusers import CosmosTransformer3DModel
from diffusers.loaders import CosmosLoraLoaderMixin

from diffpipe.config import SampleConfig
from diffpipe.families.cosmos2.family import SIGMA_DATA, Cosmos2Family, edm_weight
from diffpipe.families.cosmos2_video.flavors import TINY_TRANSFORMER_V2W
from diffpipe.models import _common as common
from diffpipe.models import _video
from diffpipe.models import objectives as obj
from diffpipe.models.base import Family, Prepared
from diffpipe.models.components import Model

#: The pipeline's ``sigma_conditioning``: the noise level the conditioned frames are read at.
SIGMA_CONDITIONING = 1e-4
#: Latent frames Cosmos-Predict2 conditions on in training, drawn uniformly per clip.
CONDITIONAL_FRAMES = (1, 2)


class Cosmos2VideoToWorldPipeline(StockCosmos2VideoToWorldPipeline, CosmosLoraLoaderMixin):
    """diffusers' ``Cosmos2VideoToWorldPipeline`` with diffusers' ``CosmosLoraLoaderMixin``.

    Same class name on purpose: ``save_pretrained`` writes it into ``model_index.json``,
    which then loads with the stock class.
    """


def t_conditioning() -> torch.Tensor:
    """The conditioned frames' timestep, computed as the pipeline computes it (float32)."""
    sigma = torch.tensor(SIGMA_CONDITIONING, dtype=torch.float32)
    return sigma / (sigma + 1)


def condition_indicator(frames_given: torch.Tensor, frames: int) -> torch.Tensor:
    """``[B, 1, F, 1, 1]``: 1 on each clip's first ``frames_given[b]`` latent frames (the pipeline's
    ``cond_indicator``, per clip)."""
    pos = torch.arange(frames, device=frames_given.device)
    return (pos[None, :] < frames_given[:, None]).float()[:, None, :, None, None]


def transformer_inputs(
    scaled: torch.Tensor, conditioning: torch.Tensor, t: torch.Tensor, indicator: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hidden_states, timestep [B,1,F,1,1], condition_mask [B,1,F,h,w])`` as the denoising loop forms them.

    ``scaled`` is ``c_in x`` (``(1 - t) x0 + t eps``), ``conditioning`` the clean
    latents whose first frames are given, ``t`` one timestep per clip.
    """
    b, _, f, h, w = scaled.shape
    hidden = indicator * conditioning + (1 - indicator) * scaled
    timestep = t.float().view(b, 1, 1, 1, 1).expand(b, 1, f, 1, 1)
    timestep = indicator * t_conditioning().to(scaled.device) + (1 - indicator) * timestep
    return hidden, timestep, indicator.expand(b, 1, f, h, w)


def video_shift(latent_frames: int) -> float:
    """Cosmos-Predict2's video noise multiplier ``sqrt(T)`` as a timestep shift."""
    return math.sqrt(latent_frames)


class Cosmos2VideoFamily(Cosmos2Family):
    #: Not the parent family's layers: this family's spec says why it has none.
    pipeline_layers = Family.pipeline_layers
    denoiser_model = Model(CosmosTransformer3DModel, TINY_TRANSFORMER_V2W)
    pipeline_class = Cosmos2VideoToWorldPipeline
    is_video = True
    fps = 16.0

    def __init__(self, cfg):
        super().__init__(cfg)
        if cfg.flavor == "local":
            _ = self._denoiser_config  # a Text2Image folder is refused here, before anything loads

    @cached_property
    def _denoiser_config(self) -> dict[str, Any]:
        config = Family._denoiser_config.func(self)
        if self.cfg.flavor == "local" and config.get("in_channels") != config.get("out_channels", 16) + 1:
            raise ValueError(
                f"model.path {self.cfg.path}: transformer/config.json has in_channels "
                f"{config.get('in_channels')}, not latent channels + 1 (the condition mask): this is not a "
                "Cosmos-Predict2 Video2World model (a Text2Image model is family `cosmos2`)"
            )
        return config

    @property
    def frame_rule(self) -> tuple[int, int]:
        """``(step, offset)``: the causal VAE keeps one key frame and compresses time by ``step``."""
        return 2 ** sum(bool(x) for x in self._vae_config["temperal_downsample"]), 1

    # -- encoding --------------------------------------------------------------
    def encode_pixels(self, vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        # The causal VAE encodes a clip at once; as prepare_latents normalises the conditioning latents:
        # ``(latents - mean) / std * sigma_data``.
        latents = common.vae_latents(vae, pixels, per_frame=False)
        mean, std = common.latent_stats(vae, latents)
        return (latents - mean) / std * SIGMA_DATA

    # -- training ----------------------------------------------------------------
    def conditional_frames(self, b: int, frames: int, generator: torch.Generator | None) -> torch.Tensor:
        """Latent frames given per clip: drawn from ``CONDITIONAL_FRAMES`` (None: 1), always leaving one
        to generate; 0 for single-frame items."""
        lo, hi = CONDITIONAL_FRAMES
        if generator is None:
            k = torch.full((b,), lo)
        else:
            k = torch.randint(lo, hi + 1, (b,), generator=generator, device=generator.device).cpu()
        return k.clamp(max=frames - 1)

    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32, conditional_frames: torch.Tensor | None = None) -> Prepared:
        """The transformer's inputs as the pipeline builds them (per-frame timestep, condition mask,
        the family's fps, an all-zero padding mask), the clip's first frames given (see the module doc).

        ``conditional_frames`` (``[B]`` latent frames given) fixes ``k``; otherwise it
        is drawn after ``t`` and noise, or 1 when ``t`` is given (evaluation).
        """
        o = objective
        x0 = _video.check_video_latents(latents, self.name)
        b, _, f = x0.shape[:3]
        fixed = t is not None
        t, noise = _video.draw(o, x0, generator, t, noise)
        t = obj.shift_timesteps(t, o.shift or video_shift(f))
        if conditional_frames is None:
            conditional_frames = self.conditional_frames(b, f, None if fixed else generator)
        indicator = condition_indicator(conditional_frames.to(x0.device), f)
        hidden, timestep, condition_mask = transformer_inputs(obj.flow_interpolate(x0, noise, t), x0, t, indicator)
        inputs = {
            "hidden_states": hidden.to(dtype),
            "timestep": timestep.to(dtype),
            "encoder_hidden_states": text["prompt_embeds"].to(device=x0.device, dtype=dtype),
            "fps": int(self.fps),
            "condition_mask": condition_mask.to(dtype),
            "padding_mask": hidden.new_zeros(1, 1, *hidden.shape[-2:], dtype=dtype),
        }
        return Prepared(inputs, obj.flow_target(x0, noise), edm_weight(t), self.loss_mask(mask, x0, o),
                        extra={"indicator": indicator})

    def predict(self, denoiser: torch.nn.Module, prepared: Prepared) -> torch.Tensor:
        """The transformer's output, replaced on the given frames by their clean latents (as the pipeline
        does): no error there."""
        pred = super().predict(denoiser, prepared).float()
        return torch.where(prepared.extra["indicator"].bool(), prepared.target, pred)

    # -- sampling ----------------------------------------------------------------
    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        if not cfg.images:
            raise ValueError(
                "sample.images: Cosmos-Predict2 Video2World continues an image; give one per sample.prompts"
            )
        return {
            **super().sample_kwargs(cfg),
            "fps": int(self.fps),
        }

    def pipeline_inputs(self, *args: Any, **kwargs: Any) -> Any:
        # cosmos2's single-frame inputs do not apply: refuse rather than inherit them.
        self.pipeline_layers(None)
