"""The training math: timestep sampling, noising, targets, loss weights.

Pure, stateless functions on tensors. Randomness comes only from the
``torch.Generator`` passed in, so a fixed generator gives fixed draws.
Timesteps are fractions ``t`` in [0, 1): for flow matching ``t`` is the
noise level sigma; for DDPM it maps to an integer step with
``ddpm_timesteps``.
"""

from __future__ import annotations

import torch
from diffusers.schedulers.scheduling_ddpm import rescale_zero_terminal_snr as _diffusers_zero_terminal_snr
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3


def _expand_like(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``[B]`` -> ``[B, 1, ..., 1]`` broadcastable against ``x``."""
    return t.reshape(t.shape[0], *([1] * (x.ndim - 1))).to(x.dtype)


# -- timestep sampling -----------------------------------------------------
def sample_uniform(n: int, generator: torch.Generator, *, device: torch.device | str = "cpu") -> torch.Tensor:
    """``n`` timesteps uniform in [0, 1) (the DDPM default, Ho et al. 2020)."""
    return torch.rand(n, generator=generator, device=device)


def sample_logit_normal(
    n: int,
    generator: torch.Generator,
    *,
    mean: float = 0.0,
    std: float = 1.0,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``n`` timesteps ``sigmoid(N(mean, std))``: more weight on middle noise levels.

    Logit-normal sampling from Esser et al. 2024 (SD3, "Scaling Rectified Flow
    Transformers"); ``mean=0, std=1`` is their recommended setting.
    """
    return compute_density_for_timestep_sampling("logit_normal", n, logit_mean=mean, logit_std=std,
                                                 device=device, generator=generator)


def shift_timesteps(t: torch.Tensor, shift: float) -> torch.Tensor:
    """Fixed timestep shift ``t' = s t / (1 + (s - 1) t)`` (Esser et al. 2024, SD3).

    ``s > 1`` moves timesteps towards pure noise, which larger images need
    because they keep more signal at a given noise level. Keeps 0 and 1 fixed
    and is monotonic for ``s > 0``. A resolution-dependent shift ``exp(mu)``
    (Flux) is this function with ``s = exp(mu)``.
    """
    return shift * t / (1 + (shift - 1) * t)


def ddpm_timesteps(t: torch.Tensor, num_train_timesteps: int = 1000) -> torch.Tensor:
    """Fractions in [0, 1) -> integer DDPM steps ``min(int(t * N), N - 1)``."""
    return (t * num_train_timesteps).long().clamp(0, num_train_timesteps - 1)


# -- flow matching (rectified flow) ----------------------------------------
def flow_interpolate(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``x_t = (1 - t) x0 + t noise``: the straight path of rectified flow (Liu et al. 2022)."""
    t = _expand_like(t, x0)
    return (1 - t) * x0 + t * noise


def flow_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Velocity ``d x_t / d t = noise - x0`` that the flow model predicts."""
    return noise - x0


# -- DDPM ------------------------------------------------------------------
def _alpha_bar(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    a = alphas_cumprod.to(device=like.device, dtype=torch.float32)[timesteps.to(like.device)]
    return _expand_like(a, like)


def ddpm_add_noise(
    x0: torch.Tensor, noise: torch.Tensor, alphas_cumprod: torch.Tensor, timesteps: torch.Tensor
) -> torch.Tensor:
    """``x_t = sqrt(a) x0 + sqrt(1 - a) noise`` with ``a = alphas_cumprod[t]`` (Ho et al. 2020)."""
    a = _alpha_bar(alphas_cumprod, timesteps, x0)
    return a.sqrt() * x0 + (1 - a).sqrt() * noise


def v_target(
    x0: torch.Tensor, noise: torch.Tensor, alphas_cumprod: torch.Tensor, timesteps: torch.Tensor
) -> torch.Tensor:
    """``v = sqrt(a) noise - sqrt(1 - a) x0`` (Salimans & Ho 2022, progressive distillation)."""
    a = _alpha_bar(alphas_cumprod, timesteps, x0)
    return a.sqrt() * noise - (1 - a).sqrt() * x0


def ddpm_target(
    x0: torch.Tensor,
    noise: torch.Tensor,
    alphas_cumprod: torch.Tensor,
    timesteps: torch.Tensor,
    prediction_type: str,
) -> torch.Tensor:
    """The DDPM training target for ``prediction_type`` ``epsilon`` or ``v_prediction``."""
    if prediction_type == "epsilon":
        return noise
    if prediction_type == "v_prediction":
        return v_target(x0, noise, alphas_cumprod, timesteps)
    raise ValueError(f"prediction_type must be 'epsilon' or 'v_prediction', got {prediction_type!r}")


def snr(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
    """Signal-to-noise ratio ``a / (1 - a)`` at each timestep."""
    a = alphas_cumprod.to(torch.float32)[timesteps.to(alphas_cumprod.device)]
    return a / (1 - a)


def min_snr_weights(
    alphas_cumprod: torch.Tensor,
    timesteps: torch.Tensor,
    *,
    gamma: float = 5.0,
    prediction_type: str = "epsilon",
) -> torch.Tensor:
    """Min-SNR-gamma loss weights (Hang et al. 2023, "Efficient Diffusion Training via Min-SNR").

    The paper's weight ``min(SNR, gamma)`` applies to an x0 loss; expressed
    for an epsilon loss it is ``min(SNR, gamma) / SNR``, for a v loss
    ``min(SNR, gamma) / (SNR + 1)``.
    """
    s = snr(alphas_cumprod, timesteps)
    clipped = s.clamp(max=gamma)
    if prediction_type == "epsilon":
        return clipped / s
    if prediction_type == "v_prediction":
        return clipped / (s + 1)
    raise ValueError(f"prediction_type must be 'epsilon' or 'v_prediction', got {prediction_type!r}")


def limit_timesteps(t: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """Map ``t`` in [0, 1) linearly onto [lo, hi): train only part of the schedule."""
    return lo + (hi - lo) * t


def add_offset_noise(noise: torch.Tensor, strength: float, generator: torch.Generator) -> torch.Tensor:
    """Noise plus a random constant per sample and channel (Guttenberg 2023, "Diffusion with
    Offset Noise"): lets a UNet learn very dark or bright images."""
    offset = torch.randn(
        noise.shape[0],
        noise.shape[1],
        *([1] * (noise.ndim - 2)),
        generator=generator,
        device=generator.device,
    )
    return noise + strength * offset.to(noise.device)


# -- reduction -------------------------------------------------------------
def mask_weights(mask: torch.Tensor, min_weight: float = 0.0) -> torch.Tensor:
    """Per-element loss weights from a mask in [0, 1]: ``min_weight + (1 - min_weight) * mask``.

    ``min_weight > 0`` keeps some loss on masked-out areas (so the model does
    not drift there); 0 ignores them.
    """
    return min_weight + (1 - min_weight) * mask.float()


def reduce_per_sample(err: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of a per-element loss over every axis but the batch: ``[B]``.

    With ``mask`` (broadcastable to ``err``, non-negative) the weighted mean
    ``sum(w * err) / sum(w)`` per sample; an all-ones mask gives the plain mean,
    and a sample whose weights are all zero contributes 0.
    """
    if mask is None:
        return err.reshape(err.shape[0], -1).mean(dim=1)
    w = mask.to(device=err.device, dtype=err.dtype).expand_as(err).reshape(err.shape[0], -1)
    num = (err.reshape(err.shape[0], -1) * w).sum(dim=1)
    return num / w.sum(dim=1).clamp_min(torch.finfo(err.dtype).tiny)


def per_sample_pseudo_huber(
    pred: torch.Tensor,
    target: torch.Tensor,
    c: float,
    weights: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pseudo-Huber loss ``sqrt(d^2 + c^2) - c`` per sample ``[B]`` (Charbonnier 1994; for diffusion
    Khrapov et al. 2024, "Improving Diffusion Models's Data-Corruption Resistance")."""
    d2 = (pred.float() - target.float()).pow(2)
    err = reduce_per_sample((d2 + c * c).sqrt() - c, mask)
    return err if weights is None else err * weights.to(err.dtype)


def per_sample_loss(
    pred: torch.Tensor,
    target: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    kind: str = "mse",
    huber_c: float = 0.1,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``mse`` or ``huber`` (pseudo-Huber) per sample, optionally weighted.

    ``weights[B]`` scale whole samples (Min-SNR and other timestep weightings);
    ``mask`` (laid out like ``pred``, or broadcastable to it) weights elements
    within a sample (a loss mask, see :func:`reduce_per_sample`).
    """
    if kind == "huber":
        return per_sample_pseudo_huber(pred, target, huber_c, weights, mask)
    return per_sample_mse(pred, target, weights, mask)


def per_sample_mse(
    pred: torch.Tensor,
    target: torch.Tensor,
    weights: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean squared error per sample ``[B]`` in float32, optionally times ``weights[B]``."""
    err = reduce_per_sample((pred.float() - target.float()).pow(2), mask)
    return err if weights is None else err * weights.to(err.dtype)


# -- zero terminal SNR ---------------------------------------------------------
def rescale_zero_terminal_snr(betas: torch.Tensor) -> torch.Tensor:
    """Betas whose last timestep has zero SNR (Lin et al. 2024, "Common Diffusion Noise Schedules
    and Sample Steps are Flawed", Algorithm 1).

    diffusers' own implementation. ``sqrt(alphas_cumprod)`` is shifted so its last value is 0 and scaled so its
    first is unchanged; the betas are read back from it. The last step is then
    pure noise, which only a v (or x0) prediction can train on.
    """
    return _diffusers_zero_terminal_snr(betas)


# -- the SD3 paper's timestep densities and loss weightings ----------------------
#: ``train.objective.weighting_scheme`` values (Esser et al. 2024, section 3.1).
WEIGHTING_SCHEMES = ("none", "sigma_sqrt", "logit_normal", "mode", "cosmap")


def sample_mode(
    n: int, generator: torch.Generator, *, scale: float = 1.29, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Mode sampling with heavy tails (Esser et al. 2024, eq. 20): ``1 - u - s (cos²(πu/2) - 1 + u)``.

    ``s = 0`` is uniform; ``s > 0`` favours middle timesteps, ``s < 0`` the ends.
    """
    return compute_density_for_timestep_sampling("mode", n, mode_scale=scale, device=device, generator=generator)


def sample_weighting_scheme(
    scheme: str,
    n: int,
    generator: torch.Generator,
    *,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    mode_scale: float = 1.29,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``n`` timesteps from the density of an SD3 weighting scheme (before any shift).

    ``logit_normal``: :func:`sample_logit_normal`; ``mode``: :func:`sample_mode`;
    ``none``, ``sigma_sqrt`` and ``cosmap``: uniform (those weight the loss
    instead, :func:`weighting_scheme_weights`). The same draws as diffusers'
    ``compute_density_for_timestep_sampling`` with the same generator.
    """
    if scheme not in WEIGHTING_SCHEMES:
        raise ValueError(f"weighting_scheme must be one of {', '.join(WEIGHTING_SCHEMES)}; got {scheme!r}")
    if scheme == "logit_normal":
        return sample_logit_normal(n, generator, mean=logit_mean, std=logit_std, device=device)
    if scheme == "mode":
        return sample_mode(n, generator, scale=mode_scale, device=device)
    return sample_uniform(n, generator, device=device)


def weighting_scheme_weights(scheme: str | None, sigma: torch.Tensor) -> torch.Tensor | None:
    """Per-sample loss weights of an SD3 weighting scheme at noise level ``sigma`` (None: unweighted).

    ``sigma_sqrt``: ``sigma^-2``; ``cosmap``: ``2 / (π (1 - 2σ + 2σ²))``, the
    CosMap density (eq. 21) applied as a weight on uniform draws; the other
    schemes weight by 1 (returned as None, so the loss is untouched).
    """
    if scheme in ("sigma_sqrt", "cosmap"):
        return compute_loss_weighting_for_sd3(scheme, sigma.float())
    return None
