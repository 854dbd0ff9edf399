"""Cosmos-Predict2 Video2World (``cosmos2-video``): the objective against the pipeline's formulas, and its errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from diffpipe.config import ModelConfig, ObjectiveConfig, SampleConfig
from diffpipe.families import get_family
from diffpipe.families.cosmos2_video.family import SIGMA_CONDITIONING, condition_indicator
from diffpipe.families.published import PUBLISHED


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFPIPE_CACHE", str(tmp_path))


@pytest.fixture(scope="module")
def family():
    return get_family(ModelConfig(family="cosmos2-video"))


def test_loss_is_the_pipelines_edm_loss_on_the_generated_frames(family):
    """Velocity form = Cosmos-Predict2's ``(sigma^2+1)/sigma^2 |D - x0|^2`` with ``D`` formed as the
    pipeline forms it: given frames read clean at ``sigma_conditioning`` and replaced in ``D``."""
    tr = family.load_denoiser()
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(2, 16, 3, 4, 4, generator=g), torch.randn(2, 16, 3, 4, 4, generator=g)
    text = {"prompt_embeds": torch.randn(2, 32, 32, generator=g)}
    t, k = torch.tensor([0.2, 0.9]), torch.tensor([1, 2])
    with torch.no_grad():
        ours = family.loss(tr, x0, text, torch.Generator(), t=t, noise=eps, conditional_frames=k)
        t = t * math.sqrt(3) / (1 + (math.sqrt(3) - 1) * t)  # the video noise multiplier sqrt(3 frames)
        sigma = (t / (1 - t)).view(-1, 1, 1, 1, 1)
        latents = x0 + sigma * eps
        current_t = sigma / (sigma + 1)
        c_in, c_skip, c_out = 1 - current_t, 1 - current_t, -current_t
        ind = torch.zeros(2, 1, 3, 1, 1)
        ind[0, :, :1], ind[1, :, :2] = 1, 1
        s_cond = torch.tensor(SIGMA_CONDITIONING)
        out = tr(
            hidden_states=ind * x0 + (1 - ind) * latents * c_in,
            timestep=ind * s_cond / (s_cond + 1) + (1 - ind) * current_t.expand(2, 1, 3, 1, 1),
            encoder_hidden_states=text["prompt_embeds"],
            fps=16,
            condition_mask=ind.expand(2, 1, 3, 4, 4),
            padding_mask=torch.zeros(1, 1, 32, 32),
            return_dict=False,
        )[0]
        denoised = ind * x0 + (1 - ind) * (c_skip * latents + c_out * out.float())
        edm = ((sigma**2 + 1) / sigma**2 * (denoised - x0) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(ours, edm, rtol=1e-4, atol=1e-5)


def test_given_frames_are_drawn_like_cosmos_and_leave_one_to_generate(family):
    draws = family.conditional_frames(4000, 24, torch.Generator().manual_seed(0))
    assert set(draws.tolist()) == {1, 2} and abs(float((draws == 2).float().mean()) - 0.5) < 0.05
    assert family.conditional_frames(8, 2, torch.Generator()).tolist() == [1] * 8  # 5-frame clips: 2 latents
    assert family.conditional_frames(3, 1, torch.Generator()).tolist() == [0] * 3  # images: text only
    assert family.conditional_frames(2, 24, None).tolist() == [1, 1]  # evaluation: the image case
    assert condition_indicator(torch.tensor([0, 2]), 3).flatten(1).tolist() == [[0, 0, 0], [1, 1, 0]]


def test_images_train_unconditioned_and_the_objective_shift_overrides(family):
    tr = family.load_denoiser()
    g = torch.Generator().manual_seed(1)
    x0, eps = torch.randn(2, 16, 1, 4, 4, generator=g), torch.randn(2, 16, 1, 4, 4, generator=g)
    text = {"prompt_embeds": torch.randn(2, 32, 32, generator=g)}
    seen = []
    tr.register_forward_pre_hook(lambda m, a, kw: seen.append(kw), with_kwargs=True)
    t = torch.tensor([0.3, 0.6])
    with torch.no_grad():
        family.loss(tr, x0, text, torch.Generator(), t=t, noise=eps)  # 1 latent frame: shift sqrt(1) = 1
        family.loss(tr, x0, text, torch.Generator(), t=t, noise=eps, objective=ObjectiveConfig(shift=3.0))
    assert not seen[0]["condition_mask"].any()
    torch.testing.assert_close(seen[0]["timestep"].flatten(), t)
    torch.testing.assert_close(seen[1]["timestep"].flatten(), 3 * t / (1 + 2 * t))


def test_errors_and_published_sizes(family, tmp_path):
    with pytest.raises(ValueError, match="sample.images: Cosmos-Predict2 Video2World"):
        family.sample_kwargs(SampleConfig())
    kw = family.sample_kwargs(SampleConfig(prompts=["a"], images=["x.png"], frames=10, steps=2, guidance_scale=7.0))
    assert (kw["num_frames"], kw["fps"], family.frame_rule, family.fps) == (9, 16, (4, 1), 16.0)
    with pytest.raises(ValueError, match="pipeline parallelism is not implemented yet"):
        family.pipeline_layers(family.load_denoiser())
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(
        json.dumps({"_class_name": "CosmosTransformer3DModel", "in_channels": 16, "out_channels": 16})
    )
    with pytest.raises(ValueError, match="in_channels 16.*family `cosmos2`"):
        get_family(ModelConfig(family="cosmos2-video", flavor="local", path=str(tmp_path)))
    for name, count in [
        ("cosmos-predict2-2b-video2world", 1_956_413_440),
        ("cosmos-predict2-14b-video2world", 14_265_285_632),
    ]:
        spec = PUBLISHED[name]
        model = spec.build_meta()
        assert spec.family == "cosmos2-video" and model.config.in_channels == 17
        assert sum(p.numel() for p in model.parameters()) == count and spec.params_match(count)
