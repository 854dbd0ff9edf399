"""CogView4 and Cosmos-Predict2: text caching, batch assembly and objectives against the stock pipelines' code."""

from __future__ import annotations

import diffusers
import numpy as np
import pytest
import torch
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from diffpipe.config import ModelConfig
from diffpipe.export.diffusers_format import export_diffusers
from diffpipe.families import get_family
from diffpipe.families.cogview4.family import padded_length
from diffpipe.families.cosmos2.family import PassThroughSafetyChecker
from diffpipe.models import objectives as obj

CAPTIONS = ["a white circle on a black background", "x", "", "a white triangle " * 8]


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFPIPE_CACHE", str(tmp_path))


@pytest.fixture(scope="module")
def cogview4():
    family = get_family(ModelConfig(family="cogview4"))
    return family, family.load_pipeline()


def test_cogview4_cache_rows_are_the_pipelines_embeddings(cogview4):
    family, pipe = cogview4
    text = family.encode_text(family.load_text_encoders(), CAPTIONS)
    width = family.max_sequence_length
    assert text["prompt_embeds"].shape[:2] == text["prompt_embeds_mask"].shape == (len(CAPTIONS), width)
    lengths = []
    for i, caption in enumerate(CAPTIONS):
        theirs, _ = pipe.encode_prompt(caption, do_classifier_free_guidance=False, max_sequence_length=width)
        n = theirs.shape[1]
        lengths.append(n)
        assert n % 16 == 0 and n <= width
        # right-aligned: zeros and mask 0 before the prompt, the pipeline's embedding after
        assert text["prompt_embeds_mask"][i].tolist() == [0.0] * (width - n) + [1.0] * n
        assert not text["prompt_embeds"][i, : width - n].any()
        torch.testing.assert_close(text["prompt_embeds"][i, width - n :], theirs[0], rtol=1e-5, atol=1e-6)
    assert len(set(lengths)) >= 3 and lengths[-1] == width  # the long caption is truncated to the limit
    assert padded_length(1) == 16 and padded_length(16) == 16 and padded_length(17) == 32


def test_cogview4_batch_equals_each_prompt_alone(cogview4):
    """Prompts of different lengths in one batch: each item's prediction (and loss) equals the
    transformer's on that prompt alone, at the pipeline's own embedding length."""
    family, pipe = cogview4
    text = family.encode_text(family.load_text_encoders(), CAPTIONS[:3])
    g = torch.Generator().manual_seed(0)
    latents, noise = torch.randn(3, 4, 1, 8, 8, generator=g), torch.randn(3, 4, 1, 8, 8, generator=g)
    t = torch.tensor([0.2, 0.5, 0.9])
    tr = pipe.transformer
    calls = []
    hook = tr.register_forward_hook(
        lambda m, a, kw, out: calls.append(kw["encoder_hidden_states"].shape[:2]), with_kwargs=True
    )
    with torch.no_grad():
        batch = family.loss(tr, latents, text, torch.Generator(), t=t, noise=noise)
        alone = torch.cat(
            [
                family.loss(
                    tr,
                    latents[i : i + 1],
                    {k: v[i : i + 1] for k, v in text.items()},
                    torch.Generator(),
                    t=t[i : i + 1],
                    noise=noise[i : i + 1],
                )
                for i in range(3)
            ]
        )
        sigma = obj.shift_timesteps(t[:1], family.timestep_shift(16))
        x0, eps = latents[:1, :, 0], noise[:1, :, 0]
        embeds, _ = pipe.encode_prompt(
            CAPTIONS[0], do_classifier_free_guidance=False, max_sequence_length=family.max_sequence_length
        )
        size = torch.tensor([[64.0, 64.0]])
        direct = tr(
            hidden_states=obj.flow_interpolate(x0, eps, sigma),
            encoder_hidden_states=embeds,
            timestep=sigma * 1000,
            original_size=size,
            target_size=size,
            crop_coords=torch.zeros(1, 2),
            return_dict=False,
        )[0]
    hook.remove()
    # the batch: one call per distinct prompt length (32 and 16 tokens); then 3 single items and the direct call
    assert len(calls) == 6 and sorted(c[1] for c in calls[:2]) == [16, 32] and calls[0][0] + calls[1][0] == 3
    torch.testing.assert_close(batch, alone, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(alone[:1], obj.per_sample_loss(direct, eps - x0), rtol=1e-5, atol=1e-6)


def test_cogview4_shift_is_the_schedulers(cogview4):
    family, pipe = cogview4
    for tokens in (16, 1024, 4096):
        h = w = int(tokens**0.5) * 2 * 8  # pixels giving that many 2x2 patches of factor-8 latents
        seq = (h // 8) * (w // 8) // 4
        mu = diffusers.pipelines.cogview4.pipeline_cogview4.calculate_shift(seq, 256, 0.25, 0.75)
        sigmas = np.array([0.9, 0.5, 0.1], dtype=np.float32)
        pipe.scheduler.set_timesteps(sigmas=sigmas, mu=mu)
        ours = obj.shift_timesteps(torch.from_numpy(sigmas), family.timestep_shift(seq))
        torch.testing.assert_close(pipe.scheduler.sigmas[:3].float(), ours, rtol=1e-5, atol=1e-6)
    assert family.timestep_shift(256) == pytest.approx(1.0)  # mu = 0.75 + 0.25, applied linearly


def test_cosmos2_loss_is_the_pipelines_preconditioned_edm_loss():
    """The loss in velocity form equals Cosmos-Predict2's ``(sigma^2+1)/sigma^2 |D - x0|^2`` with ``D``
    formed exactly as ``Cosmos2TextToImagePipeline`` forms it from the transformer's output."""
    family = get_family(ModelConfig(family="cosmos2"))
    tr = family.load_denoiser()
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(3, 16, 1, 8, 8, generator=g), torch.randn(3, 16, 1, 8, 8, generator=g)
    text = {"prompt_embeds": torch.randn(3, 32, 32, generator=g)}
    t = torch.tensor([0.05, 0.5, 0.95])
    with torch.no_grad():
        ours = family.loss(tr, x0, text, torch.Generator(), t=t, noise=eps)
        sigma = (t / (1 - t)).view(-1, 1, 1, 1, 1)
        latents = x0 + sigma * eps  # the pipeline's EDM state at noise level sigma
        current_t = sigma / (sigma + 1)  # the pipeline's preconditioning
        c_in, c_skip, c_out = 1 - current_t, 1 - current_t, -current_t
        out = tr(
            hidden_states=latents * c_in,
            timestep=current_t.flatten(),
            encoder_hidden_states=text["prompt_embeds"],
            padding_mask=torch.zeros(1, 1, 64, 64),
            return_dict=False,
        )[0]
        denoised = c_skip * latents + c_out * out.float()
        edm = ((sigma**2 + 1) / sigma**2 * (denoised - x0) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(ours, edm, rtol=1e-4, atol=1e-5)


def test_cosmos2_export_loads_into_the_stock_pipeline(tmp_path):
    """diffusers 0.42.1's Cosmos2TextToImagePipeline has no load_lora_weights: our diffusers-format file
    (written by CosmosLoraLoaderMixin) loads into the stock pipeline's transformer with load_lora_adapter
    (``use_safetensors=True``, else the header with the trained alpha is not read)."""
    family = get_family(ModelConfig(family="cosmos2"))
    assert not hasattr(diffusers.Cosmos2TextToImagePipeline, "load_lora_weights")
    trained = family.load_denoiser()
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=family.default_lora_targets)
    trained.add_adapter(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in trained.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    out = export_diffusers(get_peft_model_state_dict(trained), cfg, tmp_path / "lora.safetensors", family)
    pipe = family.load_pipeline()
    stock = diffusers.Cosmos2TextToImagePipeline(
        **{k: getattr(pipe, k) for k in ("text_encoder", "tokenizer", "transformer", "vae", "scheduler")},
        safety_checker=PassThroughSafetyChecker(),
    )
    stock.transformer.load_lora_adapter(str(out), prefix="transformer", use_safetensors=True)
    g = torch.Generator().manual_seed(0)
    x0, text = torch.randn(1, 16, 1, 8, 8, generator=g), {"prompt_embeds": torch.randn(1, 32, 32, generator=g)}
    args = dict(t=torch.tensor([0.4]), noise=torch.randn(1, 16, 1, 8, 8, generator=g))
    with torch.no_grad():
        torch.testing.assert_close(
            family.loss(stock.transformer, x0, text, torch.Generator(), **args),
            family.loss(trained, x0, text, torch.Generator(), **args),
        )


def test_cosmos2_safety_checker_stand_in_is_for_the_tiny_flavor_only(monkeypatch, tmp_path):
    checker = get_family(ModelConfig(family="cosmos2")).safety_checker()
    frames = np.zeros((1, 8, 8, 3), dtype=np.uint8)
    assert checker.check_text_safety("anything") and checker.check_video_safety(frames) is frames
    (tmp_path / "model_index.json").write_text("{}")  # a model folder is never empty (hub.resolved)
    local = get_family(ModelConfig(family="cosmos2", flavor="local", path=str(tmp_path)))
    monkeypatch.setattr("diffpipe.families.cosmos2.family.is_cosmos_guardrail_available", lambda: False)
    with pytest.raises(ValueError, match="pip install cosmos_guardrail"):
        local.safety_checker()
