"""Zero terminal SNR (sd, sdxl), the SD3 weighting schemes, and SDXL's size / crop conditioning.

Each on the tiny flavors with the real diffusers models and schedulers; the
pure helpers are checked against diffusers' own implementations.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, EulerDiscreteScheduler
from diffusers.schedulers.scheduling_ddpm import rescale_zero_terminal_snr
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3
from PIL import Image

from diffpipe.config import ConfigError, ModelConfig, ObjectiveConfig, parse_config
from diffpipe.data.cache.buckets import crop_top_left, load_image_array
from diffpipe.families import get_family
from diffpipe.models import objectives as obj

VPRED_ZTSNR = {"prediction_type": "v_prediction", "zero_terminal_snr": True}


def _inputs(b: int, width: int, seq: int, pooled: int | None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(b, 4, 1, 8, 8, generator=g)
    text = {"prompt_embeds": torch.randn(b, seq, width, generator=g)}
    if pooled:
        text["pooled_prompt_embeds"] = torch.randn(b, pooled, generator=g)
    return latents, text


# -- zero terminal SNR -----------------------------------------------------------------
def test_rescaled_schedule_ends_at_zero_snr():
    plain = get_family(ModelConfig(family="sd", prediction_type="v_prediction"))
    family = get_family(ModelConfig(family="sd", **VPRED_ZTSNR))
    before, after = plain._alphas_cumprod, family._alphas_cumprod
    assert after[-1].item() == 0.0 and before[-1].item() > 0
    torch.testing.assert_close(after[0], before[0])  # the first step keeps its noise level
    assert (after.diff() < 0).all()  # still a noise schedule
    betas = plain.noise_scheduler().betas
    torch.testing.assert_close(obj.rescale_zero_terminal_snr(betas), rescale_zero_terminal_snr(betas.clone()))


def test_zero_terminal_snr_trains_with_v_prediction():
    family = get_family(ModelConfig(family="sd", **VPRED_ZTSNR))
    plain = get_family(ModelConfig(family="sd", prediction_type="v_prediction"))
    unet = family.load_denoiser()
    latents, text = _inputs(2, 32, 77, None)
    args = {"t": torch.tensor([0.5, 0.9999]), "noise": torch.randn(latents.shape)}  # 0.9999: step 999, SNR 0
    with torch.no_grad():
        loss = family.loss(unet, latents, text, torch.Generator(), **args)
        before = plain.loss(unet, latents, text, torch.Generator(), **args)
        snr = family.loss(unet, latents, text, torch.Generator(), objective=ObjectiveConfig(min_snr_gamma=5), **args)
    assert torch.isfinite(loss).all() and torch.isfinite(snr).all()
    assert loss[1] != before[1]  # the last step is noised differently
    assert snr[1] == 0  # Min-SNR gives the zero-SNR step no weight


def test_zero_terminal_snr_refuses_epsilon():
    with pytest.raises(ConfigError, match=r"model\.zero_terminal_snr.*model\.prediction_type: v_prediction"):
        parse_config({"model": {"family": "sd", "prediction_type": "epsilon", "zero_terminal_snr": True}})
    with pytest.raises(ConfigError, match=r"model\.zero_terminal_snr applies to .*sd and sdxl"):
        parse_config({"model": {"family": "flux", "zero_terminal_snr": True}})
    # Prediction type left to the scheduler, whose (tiny: SD 1.x) setting is epsilon.
    family = get_family(ModelConfig(family="sdxl", zero_terminal_snr=True))
    unet = family.load_denoiser()
    latents, text = _inputs(1, 64, 77, 32)
    with pytest.raises(
        ValueError,
        match=r"model\.zero_terminal_snr needs model\.prediction_type: v_prediction.*"
        r"'epsilon'",
    ):
        family.loss(unet, latents, text, torch.Generator().manual_seed(0))


def test_sampling_uses_the_rescaled_schedule(tmp_path):
    family = get_family(ModelConfig(family="sd", **VPRED_ZTSNR))
    pipe = family.load_pipeline()
    sched = pipe.scheduler
    assert isinstance(sched, DDIMScheduler) and sched.config.rescale_betas_zero_snr
    assert sched.config.timestep_spacing == "trailing" and sched.config.prediction_type == "v_prediction"
    torch.testing.assert_close(sched.alphas_cumprod, family._alphas_cumprod)  # training and sampling agree
    sched.set_timesteps(4)
    assert sched.timesteps[0] == 999  # sampling starts at pure noise
    pipe.set_progress_bar_config(disable=True)
    image = pipe(
        prompt="a red circle",
        num_inference_steps=2,
        height=32,
        width=32,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).images
    assert np.isfinite(image).all()
    # The saved pipeline (merged export) carries the schedule; loaded as a local model it keeps it.
    pipe.save_pretrained(tmp_path)
    local = get_family(ModelConfig(family="sd", flavor="local", path=str(tmp_path)))
    assert local.zero_terminal_snr and local.prediction_type == "v_prediction"
    torch.testing.assert_close(local._alphas_cumprod, family._alphas_cumprod)

    xl = get_family(ModelConfig(family="sdxl", **VPRED_ZTSNR))
    euler = xl.inference_scheduler()
    assert isinstance(euler, EulerDiscreteScheduler) and euler.config.timestep_spacing == "trailing"
    # Euler keeps the last step a hair above zero (2^-24) so its sigma stays finite.
    torch.testing.assert_close(euler.alphas_cumprod[:-1], xl._alphas_cumprod[:-1])
    assert xl._alphas_cumprod[-1] == 0 and euler.alphas_cumprod[-1] < 1e-7


# -- SD3 weighting schemes -------------------------------------------------------------------
@pytest.mark.parametrize("scheme", obj.WEIGHTING_SCHEMES)
def test_weighting_scheme_matches_diffusers(scheme):
    ours = obj.sample_weighting_scheme(
        scheme, 256, torch.Generator().manual_seed(3), logit_mean=0.3, logit_std=0.8, mode_scale=1.29
    )
    theirs = compute_density_for_timestep_sampling(
        scheme, 256, logit_mean=0.3, logit_std=0.8, mode_scale=1.29, generator=torch.Generator().manual_seed(3)
    )
    torch.testing.assert_close(ours, theirs)
    assert 0 <= ours.min() and ours.max() <= 1
    sigma = torch.linspace(0.05, 0.95, 7)
    weights = obj.weighting_scheme_weights(scheme, sigma)
    expected = compute_loss_weighting_for_sd3(scheme, sigma)
    torch.testing.assert_close(torch.ones_like(sigma) if weights is None else weights, expected)


def test_weighting_scheme_values_by_hand():
    sigma = torch.tensor([0.25, 0.5])
    torch.testing.assert_close(obj.weighting_scheme_weights("sigma_sqrt", sigma), torch.tensor([16.0, 4.0]))
    # cosmap: 2 / (pi (1 - 2s + 2s^2)); at s = 0.5 that is 4 / pi.
    torch.testing.assert_close(obj.weighting_scheme_weights("cosmap", sigma)[1], torch.tensor(4 / np.pi))
    u = torch.rand(5, generator=torch.Generator().manual_seed(1))
    mode = obj.sample_mode(5, torch.Generator().manual_seed(1), scale=0.0)
    torch.testing.assert_close(mode, 1 - u)  # s = 0: uniform


@pytest.fixture(scope="module")
def sd3():
    family = get_family(ModelConfig(family="sd3"))
    return family, family.load_denoiser(), *_inputs(3, 64, 64 + 32, 64)


def _sd3_loss(sd3, seed: int | None = None, **objective):
    """The loss at fixed t and noise, or (``seed``) with both drawn from a seeded generator."""
    family, tr, latents, text = sd3
    fixed = {
        "t": torch.tensor([0.2, 0.5, 0.8]),
        "noise": torch.randn(latents.shape, generator=torch.Generator().manual_seed(9)),
    }
    gen = torch.Generator().manual_seed(0 if seed is None else seed)
    with torch.no_grad():
        return family.loss(
            tr, latents, text, gen, objective=ObjectiveConfig(**objective), **(fixed if seed is None else {})
        )


def test_sd3_default_is_unchanged(sd3):
    family, tr, latents, text = sd3
    # The pre-scheme recipe, written out: logit-normal t, noise, shift 3, unweighted MSE.
    g = torch.Generator().manual_seed(5)
    t = torch.sigmoid(torch.randn(3, generator=g))
    noise = torch.randn(latents[:, :, 0].shape, generator=g)
    sigma = 3 * t / (1 + 2 * t)
    x0 = latents[:, :, 0]
    s = sigma[:, None, None, None]
    with torch.no_grad():
        pred = tr(
            hidden_states=(1 - s) * x0 + s * noise,
            timestep=sigma * 1000,
            encoder_hidden_states=text["prompt_embeds"],
            pooled_projections=text["pooled_prompt_embeds"],
            return_dict=False,
        )[0]
    by_hand = (pred - (noise - x0)).pow(2).reshape(3, -1).mean(dim=1)
    default = _sd3_loss(sd3, seed=5)
    assert torch.equal(default, by_hand)
    assert torch.equal(_sd3_loss(sd3, seed=5, weighting_scheme="logit_normal"), default)  # same density, unweighted
    assert torch.equal(
        _sd3_loss(sd3, seed=5, weighting_scheme="none"), _sd3_loss(sd3, seed=5, timestep_sampling="uniform")
    )
    assert not torch.equal(_sd3_loss(sd3, seed=5, weighting_scheme="mode"), default)


def test_sd3_scheme_weights_the_loss(sd3):
    plain = _sd3_loss(sd3)
    sigma = obj.shift_timesteps(torch.tensor([0.2, 0.5, 0.8]), 3.0)
    for scheme in ("sigma_sqrt", "cosmap"):
        torch.testing.assert_close(
            _sd3_loss(sd3, weighting_scheme=scheme), plain * obj.weighting_scheme_weights(scheme, sigma)
        )
    for scheme in ("none", "logit_normal", "mode"):  # densities only: fixed t, same loss
        assert torch.equal(_sd3_loss(sd3, weighting_scheme=scheme), plain)


def test_weighting_scheme_errors():
    with pytest.raises(ConfigError, match="weighting_scheme.*timestep_sampling.*not both"):
        parse_config({"train": {"objective": {"weighting_scheme": "mode", "timestep_sampling": "uniform"}}})
    with pytest.raises(ConfigError, match="mode_scale"):
        parse_config({"train": {"objective": {"mode_scale": 2.0}}})
    family = get_family(ModelConfig(family="sd"))
    latents, text = _inputs(1, 32, 77, None)
    with pytest.raises(ValueError, match=r"train\.objective\.weighting_scheme 'cosmap' applies to .*sd3"):
        family.loss(
            family.load_denoiser(),
            latents,
            text,
            torch.Generator(),
            objective=ObjectiveConfig(weighting_scheme="cosmap"),
        )


# -- SDXL size and crop conditioning -------------------------------------------------------------
def _stripes(w: int, h: int) -> Image.Image:
    """A pattern whose columns and rows all differ, so any crop offset shows."""
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    arr = np.stack([127 + 120 * np.sin(xx / 2.1), 127 + 120 * np.sin(yy / 1.7), (xx * 3 + yy) % 256], -1)
    return Image.fromarray(arr.astype(np.uint8))


@pytest.fixture(scope="module")
def sdxl_run(tmp_path_factory):
    from diffpipe.cache_jobs import cache_latents, cache_text
    from diffpipe.data.cache.plan import make_plan, read_spec
    from diffpipe.data.cache.reader import CachedDataset
    from diffpipe.data.dataset.validate import run_validation
    from diffpipe.paths import RunPaths

    root = tmp_path_factory.mktemp("sdxl-sizes")
    for folder, name, (w, h) in (("center", "wide", (120, 40)), ("random", "long", (160, 40))):
        (root / folder).mkdir()
        _stripes(w, h).save(root / folder / f"{name}.png")
        (root / folder / f"{name}.txt").write_text(f"a {name} pattern")
    cfg = parse_config(
        {
            "output_dir": str(root / "run"),
            "model": {"family": "sdxl"},
            "cache": {"shards": 1, "workers": 0},
            "datasets": [
                {"name": "center", "path": str(root / "center"), "resolution": 32},
                {"name": "random", "path": str(root / "random"), "resolution": 32, "crop": "random", "flip": True},
            ],
        }
    )
    paths, family = RunPaths(cfg.output_dir), get_family(cfg.model)
    run_validation(
        cfg.datasets,
        cfg.validation,
        manifest_path=paths.manifest,
        report_json=paths.report_json,
        report_html=paths.report_html,
    )
    make_plan(
        paths.manifest,
        cfg.datasets,
        cfg.cache,
        latent_identity=family.vae_identity(),
        text_identity=family.text_identity(),
        pixel_multiple=family.pixel_multiple,
        paths=paths,
    )
    (shard,) = paths.shard_names()
    cache_latents(paths.latent_spec(shard), paths.latent_shard(shard), cfg.model, cfg.cache)
    cache_text(paths.text_spec(shard), paths.text_shard(shard), cfg.model, cfg.cache)
    entries = {
        e["path"].rsplit("/", 1)[1] + (":flip" if e["flip"] else ""): e
        for e in read_spec(paths.latent_spec(shard))["items"]
    }
    return family, CachedDataset.from_run(paths), entries


def test_planned_crop_is_the_applied_crop(sdxl_run):
    _, _, entries = sdxl_run
    # 120x40 into the 24x44 (h x w) bucket: resized by 0.6 to 72x24, centred: 14 columns cut on the left.
    wide = entries["wide.png"]
    assert wide["bucket"] == [1, 24, 44] and wide["original_size"] == [40, 120] and wide["crop_top_left"] == [0, 14]
    # 160x40 at a random offset into the same bucket: 96x24 resized, 52 spare columns; flipped, the mirror.
    img = _stripes(160, 40)
    for key, flip in (("long.png", False), ("long.png:flip", True)):
        e = entries[key]
        top, left = e["crop_top_left"]
        assert e["flip"] == flip and top == 0 and 0 <= left <= 52
        cached = load_image_array(_png(img), (24, 44), crop=tuple(e["crop"]), flip=flip)[:, 0]
        resized = np.asarray(img.resize((96, 24), Image.Resampling.LANCZOS), dtype=np.float32) / 127.5 - 1
        if flip:
            resized = resized[:, ::-1]
        errors = [np.abs(resized[:, x : x + 44].transpose(2, 0, 1) - cached).mean() for x in range(53)]
        assert int(np.argmin(errors)) == left  # the offset the loader really cut at
    assert entries["long.png"]["crop_top_left"][1] + entries["long.png:flip"]["crop_top_left"][1] == 52


def _png(img: Image.Image) -> io.BytesIO:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    buf.seek(0)
    return buf


def test_sdxl_loss_gets_the_planned_time_ids(sdxl_run):
    from diffpipe.training.eval import aux_inputs

    family, data, _ = sdxl_run
    (idx,) = [i for i, it in enumerate(data.items) if it.path.endswith("wide.png")]
    batch = data.collate([idx])
    kw = aux_inputs(family, batch, torch.device("cpu"))
    assert torch.equal(kw["sizes"]["original_size"], torch.tensor([[40, 120]]))
    assert torch.equal(kw["sizes"]["crop_top_left"], torch.tensor([[0, 14]]))
    unet = family.load_denoiser()
    seen = []
    unet.register_forward_pre_hook(lambda m, a, k: seen.append(k["added_cond_kwargs"]["time_ids"]), with_kwargs=True)
    args = {"t": torch.tensor([0.5]), "noise": torch.randn(batch["latents"].shape)}
    with torch.no_grad():
        planned = family.loss(unet, batch["latents"], batch["text"], torch.Generator(), **args, **kw)
        unplanned = family.loss(unet, batch["latents"], batch["text"], torch.Generator(), **args)
    assert torch.equal(seen[0], torch.tensor([[40.0, 120.0, 0.0, 14.0, 24.0, 44.0]]))
    assert torch.equal(seen[1], torch.tensor([[24.0, 44.0, 0.0, 0.0, 24.0, 44.0]]))
    assert not torch.equal(planned, unplanned)


def test_crop_top_left_by_hand():
    # 200x100 (h x w) into 64x64: resized 128x64, centre crop 32 rows down; top-aligned: 0.
    assert crop_top_left((200, 100), (64, 64), (0.5, 0.5)) == (32, 0)
    assert crop_top_left((200, 100), (64, 64), (0.0, 0.5)) == (0, 0)
    assert crop_top_left((100, 200), (64, 64), (0.5, 0.25), flip=True) == (0, 48)  # 64 spare, 16 from the right
    assert crop_top_left((64, 64), (64, 64)) == (0, 0)
