"""The training math: timestep sampling, noising, targets, loss weights.

Pure, stateless functions on tensors. Randomness comes only from the
``torch.Generator`` passed in, so a fixed generator gives fixed draws.
Timesteps are fractions ``t`` in [0, 1): for flow matching ``t`` is the
noise level sigma; for DDPM it maps to an integer step with
``ddpm_timesteps``.
"""

from __future__ import annotations

import torch


def _expand_like(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``[B]`` -> ``[B, 1, ..., 1]`` broadcastable against ``x``."""
    return t.reshape(t.shape[0], *([1] * (x.ndim - 1))).to(x.dtype)


# -- timestep sampling -----------------------------------------------------
def sample_uniform(
    n: int, generator: torch.Generator, *, device: torch.device | str = "cpu"
) -> torch.Tensor:
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
    u = torch.randn(n, generator=generator, device=device)
    return torch.sigmoid(mean + std * u)


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
def _alpha_bar(
    alphas_cumprod: torch.Tensor, timesteps: torch.Tensor, like: torch.Tensor
) -> torch.Tensor:
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
    raise ValueError(
        f"prediction_type must be 'epsilon' or 'v_prediction', got {prediction_type!r}"
    )


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
    raise ValueError(
        f"prediction_type must be 'epsilon' or 'v_prediction', got {prediction_type!r}"
    )


def limit_timesteps(t: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """Map ``t`` in [0, 1) linearly onto [lo, hi): train only part of the schedule."""
    return lo + (hi - lo) * t


def add_offset_noise(
    noise: torch.Tensor, strength: float, generator: torch.Generator
) -> torch.Tensor:
    """Noise plus a random constant per sample and channel (Guttenberg 2023, "Diffusion with
    Offset Noise"): lets a UNet learn very dark or bright images."""
    offset = torch.randn(
        noise.shape[0], noise.shape[1], *([1] * (noise.ndim - 2)), generator=generator,
        device=generator.device,
    )
    return noise + strength * offset.to(noise.device)


# -- reduction -------------------------------------------------------------
def per_sample_pseudo_huber(
    pred: torch.Tensor, target: torch.Tensor, c: float, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Pseudo-Huber loss ``sqrt(d^2 + c^2) - c`` per sample ``[B]`` (Charbonnier 1994; for diffusion
    Khrapov et al. 2024, "Improving Diffusion Models's Data-Corruption Resistance")."""
    d2 = (pred.float() - target.float()).pow(2)
    err = ((d2 + c * c).sqrt() - c).reshape(pred.shape[0], -1).mean(dim=1)
    return err if weights is None else err * weights.to(err.dtype)


def per_sample_loss(
    pred: torch.Tensor,
    target: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    kind: str = "mse",
    huber_c: float = 0.1,
) -> torch.Tensor:
    """``mse`` or ``huber`` (pseudo-Huber) per sample, optionally weighted."""
    if kind == "huber":
        return per_sample_pseudo_huber(pred, target, huber_c, weights)
    return per_sample_mse(pred, target, weights)



def per_sample_mse(
    pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean squared error per sample ``[B]`` in float32, optionally times ``weights[B]``."""
    err = (pred.float() - target.float()).pow(2).reshape(pred.shape[0], -1).mean(dim=1)
    return err if weights is None else err * weights.to(err.dtype)
