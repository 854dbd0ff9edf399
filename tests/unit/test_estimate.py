"""Published sizes on the meta device, and ``diffpipe estimate``."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from typer.testing import CliRunner

from diffpipe.cli import app
from diffpipe.config import Config, ModelConfig
from diffpipe.estimate import GiB, _model_spec, estimate_memory
from diffpipe.families import family_names, get_family
from diffpipe.families.published import PUBLISHED, for_family
from diffpipe.saved_activations import saved_activation_bytes


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_meta_parameter_count_matches_the_published_figure(name):
    spec = PUBLISHED[name]
    model = spec.build_meta()
    assert all(p.device.type == "meta" for p in model.parameters())
    count = sum(p.numel() for p in model.parameters())
    assert spec.params_match(count), f"{name}: {count:,} parameters, published {spec.params:,.0f}"


def test_exact_published_counts():
    # The figures the task names: SD 1.5 UNet 859.5M, FLUX.1-dev transformer 11.90B.
    count = {n: sum(p.numel() for p in PUBLISHED[n].build_meta().parameters()) for n in ("sd15", "flux1-dev")}
    assert abs(count["sd15"] / 859.52e6 - 1) < 0.01
    assert abs(count["flux1-dev"] / 11.90e9 - 1) < 0.01


def test_every_family_has_a_published_config():
    assert all(for_family(name) for name in family_names())


def _cfg(family: str, **train) -> Config:
    return Config.model_validate(
        {"model": {"family": family}, "datasets": [{"name": "d", "path": "data", "resolution": 256}],
         "train": {"batch_size": 1, "precision": "bf16", **train}}
    )


def test_estimate_parts_follow_zero_and_rank():
    flux = estimate_memory(_cfg("flux"), model="flux1-dev", rank=16)
    assert flux.params == sum(p.numel() for p in PUBLISHED["flux1-dev"].build_meta().parameters())
    assert flux.resolution == 256 and flux.param_bytes >= 2 * flux.params
    # bf16 gradients and, without ZeRO, DeepSpeed's float32 copy of each for the master weights
    assert flux.grad_bytes == 6 * flux.trainable and flux.optimizer_bytes == 12 * flux.trainable
    assert 1 * GiB < flux.activation_bytes < 20 * GiB

    one = estimate_memory(_cfg("sd"), model="sd15", rank=16)
    r32 = estimate_memory(_cfg("sd"), model="sd15", rank=32)
    assert r32.trainable == 2 * one.trainable
    z3 = estimate_memory(_cfg("sd", zero_stage=3), gpus=4, model="sd15", rank=16)
    assert z3.param_bytes == one.param_bytes // 4 and z3.optimizer_bytes == one.optimizer_bytes // 4
    assert z3.activation_bytes == one.activation_bytes  # data parallel: each GPU holds its own batch
    big = estimate_memory(_cfg("sd"), model="sd15", rank=16, resolution=512)
    assert big.activation_bytes > 3 * one.activation_bytes  # 4x the pixels


def test_meta_activations_equal_a_real_forward():
    # The tiny SD UNet: what autograd saves on meta tensors equals what it saves on real ones.
    family = get_family(ModelConfig(family="sd"))
    unet = family.load_denoiser()
    unet.requires_grad_(False)
    unet.add_adapter(__import__("peft").LoraConfig(r=4, target_modules=family.default_lora_targets))
    latents, text = torch.randn(2, 4, 1, 16, 16), {"prompt_embeds": torch.randn(2, 77, 32)}
    t, noise = torch.tensor([0.3, 0.6]), torch.randn(2, 4, 16, 16)

    def run(model, *tensors):
        return lambda: family.loss(model, *tensors[:2], torch.Generator(), t=tensors[2], noise=tensors[3])

    real, _ = saved_activation_bytes(unet, run(unet, latents, text, t, noise))
    meta_unet = unet.to("meta")
    meta = [x.to("meta") for x in (latents, t, noise)]
    on_meta, _ = saved_activation_bytes(
        meta_unet, run(meta_unet, meta[0], {"prompt_embeds": text["prompt_embeds"].to("meta")}, meta[1], meta[2])
    )
    assert real > 0 and abs(on_meta - real) <= 0.02 * real, (on_meta, real)


def test_meta_activations_through_a_disabled_autocast_equal_a_real_forward():
    # Ideogram 4's rotary embedding opens torch.autocast(enabled=False) on its tensors' device, which torch
    # refuses for meta: the estimate makes that a no-op there, and the count still equals a real forward's.
    family = get_family(ModelConfig(family="ideogram4"))
    tr = family.load_denoiser()
    tr.requires_grad_(False)
    tr.add_adapter(__import__("peft").LoraConfig(r=4, target_modules=family.default_lora_targets))
    latents = torch.randn(2, 16, 1, 8, 12)
    text = {"prompt_embeds": torch.randn(2, 24, 416), "prompt_embeds_mask": torch.ones(2, 24)}
    t, noise = torch.tensor([0.3, 0.6]), torch.randn(2, 16, 8, 12)

    def run(model, latents, text, t, noise):
        return lambda: family.loss(model, latents, text, torch.Generator(), t=t, noise=noise)

    real, _ = saved_activation_bytes(tr, run(tr, latents, text, t, noise))
    meta_tr = tr.to("meta")
    meta_text = {k: v.to("meta") for k, v in text.items()}
    on_meta, _ = saved_activation_bytes(meta_tr, run(meta_tr, latents.to("meta"), meta_text, t.to("meta"),
                                                      noise.to("meta")))
    assert real > 0 and abs(on_meta - real) <= 0.02 * real, (on_meta, real)
    with pytest.raises(RuntimeError):  # outside the estimate, torch still refuses it
        with torch.autocast(device_type="meta", enabled=False):
            pass


def test_estimate_command(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(_cfg("sd").model_dump(mode="json")))
    result = CliRunner().invoke(app, ["estimate", "-c", str(config), "--json", "--model", "sd15"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["model"] == "sd15" and out["total_bytes"] > out["param_bytes"] > 0
    bad = CliRunner().invoke(app, ["estimate", "-c", str(config), "--model", "flux1-dev"])
    assert bad.exit_code == 1 and "flux" in bad.output


def test_estimate_reads_a_local_folder_config(tmp_path):
    # Only the denoiser's config.json is read; text shapes come from the closest published model (SD 2.1 here).
    (tmp_path / "unet").mkdir()
    PUBLISHED["sd21"].build_meta().save_config(tmp_path / "unet")
    cfg = Config.model_validate(
        {"model": {"family": "sd", "flavor": "local", "path": str(tmp_path)},
         "datasets": [{"name": "d", "path": "data", "resolution": 256}], "train": {"batch_size": 1, "precision": "fp32"}}
    )
    result = estimate_memory(cfg)
    assert result.model == str(tmp_path) and result.params == 865_910_724
    assert result.activation_bytes > 0 and result.param_bytes == 4 * result.params + 4 * result.trainable


def test_cogview4_and_cosmos2_sizes():
    # The transformers' exact sizes; their published figures are headlines ("6B", "2 billion", "14 billion").
    names = ("cogview4-6b", "cosmos-predict2-2b-t2i", "cosmos-predict2-14b-t2i")
    count = {n: sum(p.numel() for p in PUBLISHED[n].build_meta().parameters()) for n in names}
    assert count == {"cogview4-6b": 6_369_118_272, "cosmos-predict2-2b-t2i": 1_956_405_248,
                     "cosmos-predict2-14b-t2i": 14_265_265_152}
    # CogView4's loss runs on meta tensors too (every prompt at the full cached length).
    est = estimate_memory(_cfg("cogview4"), model="cogview4-6b", rank=16)
    assert est.params == count["cogview4-6b"] and est.activation_bytes > 0


@pytest.mark.parametrize(("variant", "model"), [("2.1-i2v", "wan2.1-i2v-14b"), ("2.1-flf2v", "wan2.1-flf2v-14b"),
                                                 ("2.2-5b-i2v", "wan2.2-ti2v-5b")])
def test_image_conditioned_wan_is_sized_with_its_conditioning(variant, model):
    """The estimate feeds the conditioning the loss needs: condition latents and, with an image embedder,
    CLIP states of its width (one image, or the FLF2V pair); before, the I2V variants failed there."""
    cfg = Config.model_validate(
        {"model": {"family": "wan", "variant": variant},
         "datasets": [{"name": "d", "path": "data", "resolution": 256, "frame_buckets": [9]}],
         "train": {"batch_size": 1, "precision": "bf16"}})
    est = estimate_memory(cfg, model=model, rank=16)
    assert est.activation_bytes > 0 and est.params == sum(p.numel() for p in PUBLISHED[model].build_meta().parameters())


def test_the_estimate_sizes_a_published_model_of_the_configured_variants_inputs():
    """Without --model, the flagship of the configured variant's weights; a --model whose inputs the variant
    does not take is a clear error (before, a T2V denoiser under an I2V variant failed inside the loss)."""
    def cfg(family, variant):
        return Config.model_validate(
            {"model": {"family": family, "variant": variant},
             "datasets": [{"name": "d", "path": "data", "resolution": 64, "frame_buckets": [5],
                           "control_from_first_frame": True}],
             "train": {"batch_size": 1, "precision": "bf16"}})

    for family, variant, expected in [("wan", "2.1-i2v", "wan2.1-i2v-14b"), ("wan", "2.2-5b-i2v", "wan2.2-ti2v-5b"),
                                      ("skyreels-v2", "i2v", "skyreels-v2-i2v-14b"),
                                      ("skyreels-v2", "df", "skyreels-v2-df-14b"),
                                      ("skyreels-v2", "df-i2v", "skyreels-v2-df-14b")]:
        # The pick alone (test_image_conditioned_wan_is_sized_with_its_conditioning sizes the Wan ones in full).
        assert _model_spec(cfg(family, variant), None).name == expected
    assert estimate_memory(cfg("skyreels-v2", "i2v"), rank=4).model == "skyreels-v2-i2v-14b"
    # Wan 2.2 T2V-A14B's expert takes Wan 2.1 T2V's inputs (the docs' fits table sizes 2.1 with it)
    assert estimate_memory(cfg("wan", "2.1"), model="wan2.2-t2v-a14b", rank=4).activation_bytes > 0
    with pytest.raises(ValueError, match=r"--model 'wan2.1-t2v-1.3b' is wan variant 2.1, whose inputs model.variant "
                                         r"2.1-i2v does not take; set model.variant: 2.1, or name wan2.1-i2v-14b"):
        estimate_memory(cfg("wan", "2.1-i2v"), model="wan2.1-t2v-1.3b")
    with pytest.raises(ValueError, match="is skyreels-v2 variant df, whose inputs model.variant t2v does not take"):
        estimate_memory(cfg("skyreels-v2", "t2v"), model="skyreels-v2-df-1.3b")
    est = estimate_memory(cfg("skyreels-v2", "df"), model="skyreels-v2-df-1.3b", rank=4)  # its frame-rate input
    assert est.activation_bytes > 0 and est.params == 1_435_525_696
