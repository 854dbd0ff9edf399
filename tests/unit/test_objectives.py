"""The training math against closed forms and diffusers' own schedulers."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler

from diffpipe.models import objectives as obj


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def ddpm() -> DDPMScheduler:
    # The SD 1.x schedule the sd family trains with.
    return DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")


@pytest.fixture(scope="module")
def xs() -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(1)
    return torch.randn(6, 4, 8, 8, generator=g), torch.randn(6, 4, 8, 8, generator=g)


# -- timestep sampling -----------------------------------------------------
def test_uniform_range_and_determinism():
    t = obj.sample_uniform(10_000, _gen())
    assert t.shape == (10_000,) and t.min() >= 0 and t.max() < 1
    assert abs(t.mean().item() - 0.5) < 0.01
    assert torch.equal(t, obj.sample_uniform(10_000, _gen()))
    assert not torch.equal(t, obj.sample_uniform(10_000, _gen(1)))


def test_logit_normal_median_and_spread():
    t = obj.sample_logit_normal(20_000, _gen())
    assert t.min() > 0 and t.max() < 1
    assert abs(t.median().item() - 0.5) < 0.01
    # logit(t) is N(0, 1): about 68% of draws within sigmoid(+-1).
    inside = (
        (t > torch.sigmoid(torch.tensor(-1.0))) & (t < torch.sigmoid(torch.tensor(1.0)))
    ).float()
    assert abs(inside.mean().item() - 0.6827) < 0.01


def test_logit_normal_mean_moves_median():
    t = obj.sample_logit_normal(20_000, _gen(), mean=1.0, std=0.5)
    assert abs(t.median().item() - 1 / (1 + math.exp(-1.0))) < 0.01
    assert abs(torch.logit(t).std().item() - 0.5) < 0.01


# -- shift -----------------------------------------------------------------
@pytest.mark.parametrize("s", [0.5, 1.0, 1.65, 3.0])
def test_shift_endpoints_and_monotonic(s):
    t = torch.linspace(0, 1, 101)
    shifted = obj.shift_timesteps(t, s)
    assert shifted[0] == 0 and shifted[-1] == pytest.approx(1.0)
    assert torch.all(shifted[1:] > shifted[:-1])
    if s > 1:
        assert torch.all(shifted >= t)
    # s and 1/s are inverse shifts.
    assert torch.allclose(obj.shift_timesteps(shifted, 1 / s), t, atol=1e-6)


def test_shift_one_is_identity_and_matches_diffusers():
    t = torch.linspace(0, 1, 11)
    assert torch.allclose(obj.shift_timesteps(t, 1.0), t)
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    plain = torch.linspace(1, 1 / 1000, 1000)
    assert torch.allclose(obj.shift_timesteps(plain, 3.0), sched.sigmas.float(), atol=1e-5)


def test_ddpm_timesteps_map():
    t = torch.tensor([0.0, 0.0005, 0.5, 0.9994, 0.99999])
    assert obj.ddpm_timesteps(t).tolist() == [0, 0, 500, 999, 999]
    assert obj.ddpm_timesteps(t, 10).tolist() == [0, 0, 5, 9, 9]


# -- flow matching ----------------------------------------------------------
def test_flow_interpolation_endpoints_and_velocity(xs):
    x0, noise = xs
    zeros, ones = torch.zeros(6), torch.ones(6)
    assert torch.equal(obj.flow_interpolate(x0, noise, zeros), x0)
    assert torch.equal(obj.flow_interpolate(x0, noise, ones), noise)
    # The path is straight: its derivative is the target everywhere.
    t, h = torch.full((6,), 0.3), 1e-2
    diff = (obj.flow_interpolate(x0, noise, t + h) - obj.flow_interpolate(x0, noise, t)) / h
    assert torch.allclose(diff, obj.flow_target(x0, noise), atol=1e-4)


def test_flow_interpolation_per_sample_t(xs):
    x0, noise = xs
    t = torch.linspace(0.1, 0.9, 6)
    out = obj.flow_interpolate(x0, noise, t)
    for i in range(6):
        assert torch.allclose(out[i], (1 - t[i]) * x0[i] + t[i] * noise[i])


# -- DDPM ------------------------------------------------------------------
def test_ddpm_noise_matches_diffusers(ddpm, xs):
    x0, noise = xs
    steps = torch.tensor([0, 10, 250, 500, 750, 999])
    ours = obj.ddpm_add_noise(x0, noise, ddpm.alphas_cumprod, steps)
    assert torch.allclose(ours, ddpm.add_noise(x0, noise, steps), atol=1e-6)
    v = obj.v_target(x0, noise, ddpm.alphas_cumprod, steps)
    assert torch.allclose(v, ddpm.get_velocity(x0, noise, steps), atol=1e-6)


def test_v_target_identity(ddpm, xs):
    """x0 = sqrt(a) x_t - sqrt(1-a) v and noise = sqrt(1-a) x_t + sqrt(a) v."""
    x0, noise = xs
    steps = torch.tensor([1, 100, 400, 600, 900, 999])
    x_t = obj.ddpm_add_noise(x0, noise, ddpm.alphas_cumprod, steps)
    v = obj.v_target(x0, noise, ddpm.alphas_cumprod, steps)
    a = ddpm.alphas_cumprod[steps].reshape(-1, 1, 1, 1)
    assert torch.allclose(a.sqrt() * x_t - (1 - a).sqrt() * v, x0, atol=1e-5)
    assert torch.allclose((1 - a).sqrt() * x_t + a.sqrt() * v, noise, atol=1e-5)


def test_ddpm_target_choices(ddpm, xs):
    x0, noise = xs
    steps = torch.full((6,), 300)
    assert torch.equal(obj.ddpm_target(x0, noise, ddpm.alphas_cumprod, steps, "epsilon"), noise)
    v = obj.ddpm_target(x0, noise, ddpm.alphas_cumprod, steps, "v_prediction")
    assert torch.equal(v, obj.v_target(x0, noise, ddpm.alphas_cumprod, steps))
    with pytest.raises(ValueError, match="prediction_type"):
        obj.ddpm_target(x0, noise, ddpm.alphas_cumprod, steps, "sample")


# -- min-SNR ---------------------------------------------------------------
def test_snr_decreases(ddpm):
    s = obj.snr(ddpm.alphas_cumprod, torch.arange(1000))
    assert torch.all(s[1:] < s[:-1])


@pytest.mark.parametrize("gamma", [1.0, 5.0])
def test_min_snr_weights(ddpm, gamma):
    steps = torch.arange(0, 1000, 7)
    s = obj.snr(ddpm.alphas_cumprod, steps)
    eps = obj.min_snr_weights(ddpm.alphas_cumprod, steps, gamma=gamma)
    # Weight 1 where SNR <= gamma (noisy steps), gamma / SNR where it is larger.
    assert torch.allclose(eps, torch.where(s <= gamma, torch.ones_like(s), gamma / s))
    assert torch.all(eps <= 1)
    v = obj.min_snr_weights(ddpm.alphas_cumprod, steps, gamma=gamma, prediction_type="v_prediction")
    assert torch.allclose(v, torch.minimum(s, torch.tensor(gamma)) / (s + 1))
    with pytest.raises(ValueError):
        obj.min_snr_weights(ddpm.alphas_cumprod, steps, prediction_type="x0")


# -- reduction -------------------------------------------------------------
def test_per_sample_mse(xs):
    x0, noise = xs
    loss = obj.per_sample_mse(x0, noise)
    assert loss.shape == (6,) and loss.dtype == torch.float32
    assert torch.allclose(loss, ((x0 - noise) ** 2).mean(dim=(1, 2, 3)))
    w = torch.arange(6.0)
    assert torch.allclose(obj.per_sample_mse(x0, noise, w), loss * w)
    assert obj.per_sample_mse(x0.bfloat16(), noise.bfloat16()).dtype == torch.float32
    assert torch.all(obj.per_sample_mse(x0, x0) == 0)
