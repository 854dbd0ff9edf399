"""Each model family on its tiny flavor: builds, encodes, learns, samples, reloads.

Components are built once per family (module-scoped fixtures); the file runs
in well under a minute on one thread.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import peft
import pytest
import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from family_tables import row

from diffpipe.config import ModelConfig, SampleConfig
from diffpipe.families import family_names, get_family
from diffpipe.models import _common
from diffpipe.models.base import Family
from diffpipe.models.objectives import shift_timesteps

#: Two representatives, a UNet and a transformer, checked in depth; every registered family and variant
#: takes a training step in tests/unit/test_family_runs.py. A family added here needs its rows below.
FAMILIES = ["sd", "flux"]
CAPTIONS = ["a red circle", "a blue square on green", "The quick brown fox, 42!", "x"]
LATENT_CHANNELS = {"sd": 4, "flux": 1}
TEXT_SHAPES = {
    "sd": {"prompt_embeds": (4, 77, 32)},
    "flux": {"prompt_embeds": (4, 32, 32), "pooled_prompt_embeds": (4, 32)},
}


@pytest.fixture(scope="module", autouse=True)
def _cache_dir(tmp_path_factory):
    # Tokenizer files and weight fingerprints go to a throwaway cache.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DIFFPIPE_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


def _tiny(name: str, seed: int = 0) -> Family:
    return get_family(ModelConfig(family=name, seed=seed))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> Family:
    return _tiny(request.param)


@pytest.fixture(scope="module")
def parts(family):
    """Components and one encoded batch of 4 images of 32x32 pixels."""
    vae, encoders = family.load_vae(), family.load_text_encoders()
    pixels = torch.rand(4, 3, 1, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = family.encode_pixels(vae, pixels)
    text = family.encode_text(encoders, CAPTIONS)
    t = torch.tensor([0.2, 0.4, 0.6, 0.8])
    noise = torch.randn(latents[:, :, 0].shape, generator=torch.Generator().manual_seed(1))
    return SimpleNamespace(
        vae=vae, encoders=encoders, pixels=pixels, latents=latents, text=text, t=t, noise=noise
    )


@pytest.fixture(scope="module")
def local_family(family, tmp_path_factory) -> Family:
    """The tiny pipeline saved with ``save_pretrained`` and opened as flavor ``local``."""
    folder = tmp_path_factory.mktemp(f"{family.name}-pipeline")
    family.load_pipeline().save_pretrained(folder)
    return get_family(ModelConfig(family=family.name, flavor="local", path=str(folder)))


def _with_lora(family: Family) -> torch.nn.Module:
    denoiser = family.load_denoiser()
    denoiser.add_adapter(
        peft.LoraConfig(
            r=4,
            lora_alpha=4,
            target_modules=family.default_lora_targets,
            init_lora_weights="gaussian",
        )
    )
    return denoiser


# -- build ---------------------------------------------------------------------
def test_tiny_build_is_deterministic(family):
    other = _tiny(family.name)
    builds = [
        (family.load_vae(), other.load_vae()),
        (family.load_denoiser(), other.load_denoiser()),
    ]
    enc_a, enc_b = family.load_text_encoders(), other.load_text_encoders()
    builds += [(enc_a.text_encoder, enc_b.text_encoder)]
    if family.name == "flux":
        builds += [(enc_a.text_encoder_2, enc_b.text_encoder_2)]
    for a, b in builds:
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), type(a).__name__
        assert _common.module_fingerprint(a) == _common.module_fingerprint(b)
    assert family.vae_identity() == other.vae_identity()
    assert family.text_identity() == other.text_identity()


def test_seed_changes_identities(family):
    other = _tiny(family.name, seed=1)
    assert other.vae_identity() != family.vae_identity()
    assert other.text_identity() != family.text_identity()


def test_identities_equal_in_a_fresh_process():
    code = (
        "import json, sys; from diffpipe.config import ModelConfig; "
        "from diffpipe.families import get_family\n"
        "fams = [get_family(ModelConfig(family=n)) for n in sys.argv[1:]]\n"
        "print(json.dumps([[f.vae_identity(), f.text_identity()] for f in fams]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *FAMILIES],
        capture_output=True,
        text=True,
        check=True,
        env=os.environ,
    )
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    ours = [[_tiny(n).vae_identity(), _tiny(n).text_identity()] for n in FAMILIES]
    assert theirs == ours


# -- encoding ------------------------------------------------------------------
def test_encode_pixels(family, parts):
    lat = parts.latents
    channels = row(LATENT_CHANNELS, family.name, "LATENT_CHANNELS in tests/stages/test_families.py", "<its VAE's latent channels>")
    assert lat.shape == (4, channels, 1, 16, 16)
    assert lat.dtype == torch.float32 and torch.isfinite(lat).all()
    assert torch.equal(lat, family.encode_pixels(parts.vae, parts.pixels))
    # Frames are encoded independently: two frames give two single-frame latents.
    two = family.encode_pixels(parts.vae, torch.cat([parts.pixels, parts.pixels.flip(0)], dim=2))
    assert two.shape[2] == 2
    assert torch.allclose(two[:, :, 0], lat[:, :, 0], atol=1e-5)
    assert torch.allclose(two[:, :, 1], lat.flip(0)[:, :, 0], atol=1e-5)
    assert 32 % family.pixel_multiple == 0


def test_encode_text(family, parts):
    text = parts.text
    shapes = row(TEXT_SHAPES, family.name, "TEXT_SHAPES in tests/stages/test_families.py",
                 "{<text key>: (4, *its shape) for the 4 captions}")
    assert {k: tuple(v.shape) for k, v in text.items()} == shapes
    for v in text.values():
        assert v.dtype == torch.float32 and not v.requires_grad
    again = family.encode_text(parts.encoders, CAPTIONS)
    assert all(torch.equal(text[k], again[k]) for k in text)
    # Different captions give different embeddings.
    assert not torch.equal(text["prompt_embeds"][0], text["prompt_embeds"][1])


def test_token_counts(family, parts):
    enc = parts.encoders
    counts = family.count_tokens(enc, CAPTIONS)
    limits = family.token_limits(enc)
    assert counts.keys() == limits.keys()
    assert limits["clip"] == 77
    # "a red circle": start + 3 words + end with CLIP; 3 words + </s> with T5.
    assert counts["clip"][0] == 5
    if family.name == "flux":
        assert limits["t5"] == 32 and counts["t5"][0] == 4
    long = " ".join(["word"] * 100)
    assert family.count_tokens(enc, [long])["clip"][0] > limits["clip"]


# -- training ------------------------------------------------------------------
def test_loss_is_finite_and_has_lora_grad(family, parts):
    denoiser = _with_lora(family)
    loss = family.loss(denoiser, parts.latents, parts.text, torch.Generator().manual_seed(0))
    assert loss.shape == (4,) and loss.dtype == torch.float32
    assert torch.isfinite(loss).all()
    loss.mean().backward()
    lora = [p for n, p in denoiser.named_parameters() if "lora_" in n]
    assert lora and all(p.requires_grad for p in lora)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in lora)
    frozen = [p for n, p in denoiser.named_parameters() if "lora_" not in n]
    assert all(not p.requires_grad for p in frozen)


def test_loss_is_repeatable(family, parts):
    denoiser = family.load_denoiser()
    args = (denoiser, parts.latents, parts.text)
    with torch.no_grad():
        fixed = [
            family.loss(*args, torch.Generator(), t=parts.t, noise=parts.noise) for _ in range(2)
        ]
        drawn = [family.loss(*args, torch.Generator().manual_seed(5)) for _ in range(2)]
        other_t = family.loss(*args, torch.Generator(), t=parts.t.flip(0), noise=parts.noise)
    assert torch.equal(fixed[0], fixed[1])
    # Noise may also come shaped like the latents, with the frame axis.
    with torch.no_grad():
        framed = family.loss(*args, torch.Generator(), t=parts.t, noise=parts.noise[:, :, None])
    assert torch.equal(framed, fixed[0])
    assert torch.equal(drawn[0], drawn[1])
    assert not torch.equal(fixed[0], other_t)


def test_loss_in_bf16(family, parts):
    denoiser = family.load_denoiser().to(torch.bfloat16)
    with torch.no_grad():
        loss = family.loss(
            denoiser, parts.latents, parts.text, torch.Generator(), t=parts.t, noise=parts.noise
        )
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()


def test_loss_rejects_video_latents(family, parts):
    video = parts.latents.repeat(1, 1, 2, 1, 1)
    with pytest.raises(ValueError, match=r"\[B,C,1,h,w\]"):
        family.loss(family.load_denoiser(), video, parts.text, torch.Generator())


def test_lora_overfits_a_fixed_batch(family, parts):
    torch.manual_seed(0)  # the gaussian LoRA init
    denoiser = _with_lora(family)
    opt = torch.optim.AdamW([p for p in denoiser.parameters() if p.requires_grad], lr=1e-2)

    def step_loss() -> torch.Tensor:
        gen = torch.Generator()
        return family.loss(
            denoiser, parts.latents, parts.text, gen, t=parts.t, noise=parts.noise
        ).mean()

    first = step_loss().item()
    for _ in range(20):
        loss = step_loss()
        opt.zero_grad()
        loss.backward()
        opt.step()
    last = step_loss().item()
    assert last < 0.7 * first, (first, last)


# -- sampling ------------------------------------------------------------------
def test_stock_pipeline_renders(family):
    pipe = family.load_pipeline()
    assert isinstance(pipe, family.pipeline_class)
    assert getattr(pipe, family.denoiser_name) is not None
    kwargs = family.sample_kwargs(SampleConfig(steps=2, guidance_scale=5.0, width=64, height=48))
    if family.name == "flux":
        assert kwargs["max_sequence_length"] == 32
    image = pipe("a red circle", generator=torch.Generator().manual_seed(0), **kwargs).images[0]
    assert image.size == (64, 48)


# -- local flavor --------------------------------------------------------------
def test_local_flavor_matches_tiny(family, parts, local_family):
    assert local_family.vae_identity() == family.vae_identity()
    assert local_family.text_identity() == family.text_identity()
    assert local_family.pixel_multiple == family.pixel_multiple
    cfg = SampleConfig(steps=2, guidance_scale=3.0)  # resolved, as callers pass it
    assert local_family.sample_kwargs(cfg) == family.sample_kwargs(cfg)

    enc = local_family.load_text_encoders()
    assert local_family.count_tokens(enc, CAPTIONS) == family.count_tokens(parts.encoders, CAPTIONS)
    text = local_family.encode_text(enc, CAPTIONS)
    assert all(torch.equal(text[k], parts.text[k]) for k in parts.text)
    assert torch.equal(
        local_family.encode_pixels(local_family.load_vae(), parts.pixels), parts.latents
    )

    def loss(fam: Family) -> torch.Tensor:
        with torch.no_grad():
            return fam.loss(
                fam.load_denoiser(),
                parts.latents,
                parts.text,
                torch.Generator(),
                t=parts.t,
                noise=parts.noise,
            )

    assert torch.equal(loss(local_family), loss(family))


def test_local_fingerprints_are_memoised(family, local_family, monkeypatch):
    local_family.vae_identity()
    memo = _common._memo_path()
    assert memo.exists() and any(
        local_family.cfg.path in key for key in json.loads(memo.read_text())
    )

    def no_hashing(path):
        raise AssertionError(f"re-hashed {path}")

    monkeypatch.setattr(_common, "_file_tensor_hashes", no_hashing)
    fresh = get_family(local_family.cfg)
    assert fresh.vae_identity() == family.vae_identity()
    assert fresh.text_identity() == family.text_identity()


# -- family specifics ----------------------------------------------------------
def test_flux_training_shift_matches_the_pipeline_schedule():
    fam = _tiny("flux")
    sched = fam.inference_scheduler()
    seq_len = 16 * 16  # 32x32 latents packed 2x2
    c = sched.config
    mu = calculate_shift(
        seq_len, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift
    )
    plain = torch.linspace(1.0, 1 / 8, 8)
    sched.set_timesteps(sigmas=plain.tolist(), mu=mu)
    ours = shift_timesteps(plain, fam.timestep_shift(seq_len))
    assert torch.allclose(sched.sigmas[:-1].float(), ours, atol=1e-6)


def test_sd_prediction_type_follows_config():
    eps, v = _tiny("sd"), get_family(ModelConfig(family="sd", prediction_type="v_prediction"))
    assert eps.prediction_type == "epsilon" and v.prediction_type == "v_prediction"
    assert v.inference_scheduler().config.prediction_type == "v_prediction"
    latents = torch.randn(2, 4, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    text = {"prompt_embeds": torch.zeros(2, 77, 32)}
    unet = eps.load_denoiser()
    t, noise = torch.tensor([0.1, 0.9]), torch.randn(2, 4, 16, 16)
    with torch.no_grad():
        a = eps.loss(unet, latents, text, torch.Generator(), t=t, noise=noise)
        b = v.loss(unet, latents, text, torch.Generator(), t=t, noise=noise)
    assert not torch.allclose(a, b)


def test_every_registered_family_has_golden_training_values():
    """Each family's tiny run is pinned by golden losses and a LoRA fingerprint (tests/golden.py), so a
    restructuring can show it changes no training; a new family needs its entry (``DIFFPIPE_UPDATE_GOLDEN=1``)."""
    golden = json.loads((Path(__file__).parents[1] / "assets" / "golden_losses.json").read_text())
    assert sorted(golden) == family_names()
    assert all(entry["losses"] and entry["lora"] for runs in golden.values() for entry in runs.values())
