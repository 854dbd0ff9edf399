"""train.objective options on the tiny families: weighting, loss kind, timestep limits, offset noise."""

import pytest
import torch

from diffpipe.config import ModelConfig, ObjectiveConfig
from diffpipe.families import get_family
from diffpipe.models import objectives as obj


def _inputs(family, b=3):
    g = torch.Generator().manual_seed(0)
    ch = 4 if family.name == "sd" else 1
    latents = torch.randn(b, ch, 1, 16, 16, generator=g)
    if family.name == "sd":
        text = {"prompt_embeds": torch.randn(b, 77, 32, generator=g)}
    else:
        text = {"prompt_embeds": torch.randn(b, 32, 32, generator=g), "pooled_prompt_embeds": torch.randn(b, 32)}
    return latents, text, torch.tensor([0.2, 0.5, 0.8]), torch.randn(latents.shape, generator=g)


def test_sd_min_snr_and_huber():
    family = get_family(ModelConfig(family="sd"))
    unet = family.load_denoiser()
    latents, text, t, noise = _inputs(family)
    g = torch.Generator()
    with torch.no_grad():
        plain = family.loss(unet, latents, text, g, t=t, noise=noise)
        snr = family.loss(unet, latents, text, g, t=t, noise=noise, objective=ObjectiveConfig(min_snr_gamma=5))
        huber = family.loss(unet, latents, text, g, t=t, noise=noise, objective=ObjectiveConfig(loss="huber"))
    w = obj.min_snr_weights(family._alphas_cumprod, obj.ddpm_timesteps(t), gamma=5)
    torch.testing.assert_close(snr, plain * w)
    assert (huber < plain).all()  # pseudo-Huber grows slower than the square
    with torch.no_grad():  # drawn timesteps and offset noise change the loss, deterministically
        a = family.loss(unet, latents, text, torch.Generator().manual_seed(1),
                        objective=ObjectiveConfig(offset_noise=0.1, min_timestep=0.9))
        b = family.loss(unet, latents, text, torch.Generator().manual_seed(1),
                        objective=ObjectiveConfig(offset_noise=0.1, min_timestep=0.9))
        c = family.loss(unet, latents, text, torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_flux_fixed_shift_and_uniform_sampling():
    family = get_family(ModelConfig(family="flux"))
    tr = family.load_denoiser()
    latents, text, t, noise = _inputs(family)
    g = torch.Generator()
    with torch.no_grad():
        own = family.loss(tr, latents, text, g, t=t, noise=noise)
        shifted = family.loss(tr, latents, text, g, t=t, noise=noise, objective=ObjectiveConfig(shift=1.0))
        drawn = family.loss(tr, latents, text, torch.Generator().manual_seed(0),
                            objective=ObjectiveConfig(timestep_sampling="uniform", max_timestep=0.5))
    assert not torch.equal(own, shifted) and torch.isfinite(drawn).all()


def test_pure_helpers():
    t = torch.tensor([0.0, 0.5, 0.999])
    torch.testing.assert_close(obj.limit_timesteps(t, 0.2, 0.6), torch.tensor([0.2, 0.4, 0.5996]))
    d = torch.full((2, 4), 1e-3)
    assert obj.per_sample_pseudo_huber(d, torch.zeros_like(d), c=0.1)[0].item() == pytest.approx(1e-6 / 0.2, rel=1e-3)
    noise = torch.zeros(2, 3, 4, 4)
    off = obj.add_offset_noise(noise, 0.1, torch.Generator().manual_seed(0))
    assert (off == off[:, :, :1, :1]).all() and off.abs().sum() > 0
    with pytest.raises(ValueError, match="below max_timestep"):
        ObjectiveConfig(min_timestep=0.5, max_timestep=0.5)
