"""Timestep and noise draws the families make in ``Family.prepare``, and the DDPM families' noising.

A pipeline run must see the timesteps and noise a 1-process run sees; both build
their inputs through ``prepare``, which draws here in a fixed order: ``t`` (then its
limits), then the noise (then offset noise, for the DDPM families).
``tests/stages/test_pipeline_layers.py`` checks each family's pipeline inputs
against its loss from the same generator state.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from diffpipe.config import ObjectiveConfig
from diffpipe.models import _common as common
from diffpipe.models import objectives as obj


def draw_t(
    o: ObjectiveConfig,
    b: int,
    generator: torch.Generator,
    *,
    default: str = "logit_normal",
    sample_t: Callable[[ObjectiveConfig, int, torch.Generator], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``b`` timestep fractions drawn from ``generator`` (``sample_t``, else ``objective.timestep_sampling``,
    else ``default``), within ``objective.min_timestep``/``max_timestep``."""
    if sample_t is not None:
        t = sample_t(o, b, generator)
    elif (o.timestep_sampling or default) == "uniform":
        t = obj.sample_uniform(b, generator, device=generator.device)
    else:
        t = obj.sample_logit_normal(b, generator, mean=o.logit_mean, std=o.logit_std, device=generator.device)
    return obj.limit_timesteps(t, o.min_timestep, o.max_timestep)


def draw_image(
    o: ObjectiveConfig,
    x0: torch.Tensor,
    generator: torch.Generator,
    t: torch.Tensor | None,
    noise: torch.Tensor | None,
    *,
    family: str,
    default: str = "logit_normal",
    sample_t: Callable[[ObjectiveConfig, int, torch.Generator], torch.Tensor] | None = None,
    offset_noise: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t, noise)`` float32 on ``x0``'s device (``[B]``, like ``x0`` ``[B,C,h,w]``; a clip's
    ``[B,C,F,h,w]``, whose noise may come like an image's).

    Given ones are kept (eval: fixed quantiles and noise; an image's noise may come like the
    latents, ``[B,C,1,h,w]``); missing ones are drawn from ``generator``.
    ``default``: the sampling when ``objective.timestep_sampling`` is unset;
    ``sample_t``: a family's own draw (SD3's weighting-scheme densities);
    ``offset_noise``: whether the family's loss adds ``objective.offset_noise``.
    """
    if t is None:
        t = draw_t(o, x0.shape[0], generator, default=default, sample_t=sample_t)
    if noise is None:
        noise = torch.randn(x0.shape, generator=generator, device=generator.device)
        if offset_noise and o.offset_noise:
            noise = obj.add_offset_noise(noise, o.offset_noise, generator)
    elif noise.ndim == x0.ndim + 1:
        noise = common.single_frame(noise, family)
    elif noise.ndim == x0.ndim - 1:  # an image's noise for a clip: its one frame
        noise = noise[:, :, None]
    return t.to(x0.device).float(), noise.to(x0.device).float()


def ddpm_parts(
    o: ObjectiveConfig, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, schedule: torch.Tensor,
    prediction_type: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A DDPM family's ``(noisy, steps, target, weights)`` from drawn ``t`` and ``noise``.

    ``schedule``: the family's ``alphas_cumprod``; ``weights``: Min-SNR (``objective.min_snr_gamma``)
    per sample, None when unset.
    """
    steps = obj.ddpm_timesteps(t, len(schedule))
    weights = None
    if o.min_snr_gamma:
        weights = obj.min_snr_weights(schedule, steps, gamma=o.min_snr_gamma, prediction_type=prediction_type)
    noisy = obj.ddpm_add_noise(x0, noise, schedule, steps)
    return noisy, steps, obj.ddpm_target(x0, noise, schedule, steps, prediction_type), weights
