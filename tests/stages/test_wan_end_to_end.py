"""The Wan family on its tiny flavors (2.1, 2.2 TI2V-5B, 2.2 A14B low expert and both experts), through every
real stage.

validate → plan → cache latents/text (2.1: a mixed dataset of short moving-shape
clips + images; 2.2: clips, one of them cut into two windows) → 2 DeepSpeed
steps → diffusers export → the stock ``WanPipeline.load_lora_weights`` (into
``transformer_2`` for the low expert): the trained transformer's output changes
and equals the trained adapter's → sampling writes MP4 clips. Run in-process
through the real Typer app, as in ``test_image_families.py``.

The run's losses and exported LoRA are also compared with the golden values in
``tests/assets/golden_losses.json``; ``DIFFPIPE_UPDATE_GOLDEN=1`` rewrites them
deliberately (see ``tests/golden.py``).
"""

from __future__ import annotations

import av
import pytest
import torch
import yaml
from diffusers import WanTransformer3DModel
from stage_cli import rendezvous, run_stages

from diffpipe.config import ModelConfig, ObjectiveConfig, SampleConfig, load_config
from diffpipe.data.cache.plan import read_spec
from diffpipe.data.cache.reader import CachedDataset
from diffpipe.data.dataset.demo import write_demo_dataset
from diffpipe.data.dataset.demo_video import write_demo_clips
from diffpipe.families import get_family
from diffpipe.families.published import PUBLISHED
from diffpipe.families.wan.family import detect_variant
from diffpipe.paths import RunPaths
from diffpipe.training.adapter import apply_adapter, load_adapter

pytestmark = pytest.mark.slow


def _run_stages(root, model: dict, dataset: dict, export: list[str], sample_steps: int = 2, train: dict | None = None):
    """Every stage of one tiny run under ``root`` (data already written to ``root/data``); ``train`` adds settings."""
    monkeypatch = rendezvous()
    cfg = {
        "output_dir": "run",
        "model": model,
        "datasets": [{"name": "mixed", "path": str(root / "data"), "resolution": 32, **dataset}],
        "cache": {"shards": 1, "workers": 0},
        "train": {
            "max_steps": 2,
            "batch_size": 2,
            "lr": 0.01,
            "save_every_epochs": 0,
            "eval": {"quantiles": []},
            **(train or {}),
        },
        "export": {"formats": export},
        "sample": {
            "prompts": ["a red circle moving left to right"],
            "steps": sample_steps,
            "width": 32,
            "height": 32,
            "frames": 5,
        },
    }
    config = root / "wan.yaml"
    config.write_text(yaml.safe_dump(cfg))
    c = str(config)
    try:
        paths = RunPaths(root / "run")
        run_stages(c, cwd=root, monkeypatch=monkeypatch, empty_caption=True)
    finally:
        monkeypatch.undo()
    return load_config(config), paths


@pytest.fixture(scope="module")
def wan_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan")
    write_demo_dataset(root / "data", n=2, size=32)
    write_demo_clips(root / "data", n=2, frames=7, width=48, height=32, fps=16)
    return _run_stages(root, {"family": "wan", "flavor": "tiny"}, {"frame_buckets": [5]}, ["diffusers", "peft"])


def _clip_run(tmp_path_factory, name: str, model: dict, export: tuple[str, ...] = ("diffusers",), train=None):
    """A 2.2 run on clips only: a 7-frame clip (one window of 5) and an 11-frame one (two windows)."""
    root = tmp_path_factory.mktemp(name)
    write_demo_clips(root / "data", n=1, frames=7, width=48, height=32, fps=16)
    write_demo_clips(root / "data" / "long", n=1, frames=11, width=48, height=32, fps=16, seed=1)
    dataset = {"frame_buckets": [5], "clip_windows": "multiple"}
    return _run_stages(root, model, dataset, list(export), sample_steps=1, train=train)


@pytest.fixture(scope="module")
def wan22_5b_run(tmp_path_factory):
    return _clip_run(tmp_path_factory, "wan22_5b", {"family": "wan", "flavor": "tiny", "variant": "2.2-5b"})


@pytest.fixture(scope="module")
def a14b_low_run(tmp_path_factory):
    return _clip_run(
        tmp_path_factory, "a14b_low", {"family": "wan", "flavor": "tiny", "variant": "2.2-a14b", "expert": "low"}
    )


@pytest.fixture(scope="module")
def a14b_both_run(tmp_path_factory):
    model = {"family": "wan", "flavor": "tiny", "variant": "2.2-a14b", "expert": "both"}
    # Uniform t (shift 12: the boundary sigma 0.875 is t = 0.37) over the whole schedule; the run's
    # seeded draws (t about 0.04, 0.45 | 0.07, 0.27) send one sample to the high expert, three to the low.
    objective = {"timestep_sampling": "uniform"}
    return _clip_run(tmp_path_factory, "a14b_both", model, ("diffusers", "peft", "merged"), {"objective": objective})


@pytest.mark.parametrize("fixture", ["wan_run", "wan22_5b_run", "a14b_low_run", "a14b_both_run"])
def test_golden_losses_and_lora(fixture, request, golden):
    """Each Wan run's 2 losses and exported LoRA(s) equal the stored golden values (tests/golden.py)."""
    _, p = request.getfixturevalue(fixture)
    golden("wan", f"test_wan_end_to_end::{fixture}", p)


def test_plan_and_cache_hold_clips_and_images(wan_run):
    _, p = wan_run
    items = read_spec(p.latent_spec("s0000"))["items"]
    clips = [it for it in items if it["path"].endswith(".mp4")]
    # 7 frames at 16 fps (Wan's rate): the 4k+1 bucket 5, first window; images stay single frames.
    assert len(clips) == 2 and all(it["bucket"] == [5, 32, 48] and it["frames"] == [0, 1, 2, 3, 4] for it in clips)
    assert sum(it["bucket"][0] == 1 for it in items) == 2
    ds = CachedDataset.from_run(p)
    shapes = {tuple(ds.collate([i])["latents"].shape[1:]) for i in range(len(ds))}
    assert shapes == {(16, 2, 4, 6), (16, 1, 4, 4)}  # 5 frames -> 2 latent frames; 1 -> 1


def test_stages_write_their_outputs(wan_run):
    _, p = wan_run
    for f in [p.manifest, p.adapter_file, p.metrics, p.export_diffusers, p.sample_grid]:
        assert f.exists(), f
    assert len(p.metrics.read_text().splitlines()) == 2
    clip = p.samples_dir / "sample-00.mp4"
    with av.open(str(clip)) as container:
        frames = list(container.decode(video=0))
    assert len(frames) == 5 and (frames[0].width, frames[0].height) == (32, 32)


def test_training_sampler_writes_clips(wan_run, tmp_path):
    from diffpipe.training.sample import TrainingSampler

    cfg, _ = wan_run
    family = get_family(cfg.model)
    sampler = TrainingSampler(
        family, SampleConfig(prompts=["a"], steps=1, width=32, height=32, frames=5), family.load_denoiser(), tmp_path
    )
    png, row = sampler(3)
    assert png.exists() and row.size == (32, 32)
    with av.open(str(tmp_path / "step-000003-00.mp4")) as container:
        assert len(list(container.decode(video=0))) == 5


def _denoiser_output(family, denoiser, batch) -> torch.Tensor:
    out = []
    handle = denoiser.register_forward_hook(lambda m, a, o: out.append(o[0] if isinstance(o, tuple) else o.sample))
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            family.loss(
                denoiser, batch["latents"], batch["text"], torch.Generator(), t=torch.tensor([0.3, 0.7]), noise=noise
            )
    finally:
        handle.remove()
    return out[0]


def test_lora_loads_in_stock_pipeline_and_matches_training(wan_run):
    cfg, p = wan_run
    family = get_family(cfg.model)
    ds = CachedDataset.from_run(p)
    clip_rows = [i for i in range(len(ds)) if ds.items[i].path.endswith(".mp4")]
    batch = ds.collate(clip_rows)
    pipe = family.load_pipeline()
    assert isinstance(pipe, family.pipeline_class)
    base = _denoiser_output(family, pipe.transformer, batch)
    pipe.load_lora_weights(str(p.export_diffusers))
    loaded = _denoiser_output(family, pipe.transformer, batch)
    expected = _denoiser_output(family, apply_adapter(family.load_denoiser(), p.adapter_dir), batch)
    assert (loaded - base).abs().max() > 1e-5, "the LoRA does not change the output"
    torch.testing.assert_close(loaded, expected, rtol=1e-5, atol=1e-5)


def test_text_cache_equals_the_pipeline_prompt_embeds(wan_run):
    cfg, _ = wan_run
    family = get_family(cfg.model)
    captions = ["a red circle", "a blue square moving left to right"]
    ours = family.encode_text(family.load_text_encoders(), captions)["prompt_embeds"]
    pipe = family.load_pipeline()
    with torch.no_grad():
        theirs = pipe._get_t5_prompt_embeds(captions, max_sequence_length=family.max_sequence_length)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_local_flavor_loads_the_saved_pipeline(wan_run, tmp_path):
    cfg, _ = wan_run
    family = get_family(cfg.model)
    family.load_pipeline().save_pretrained(tmp_path)
    local = get_family(ModelConfig(family="wan", flavor="local", path=str(tmp_path)))
    assert local.vae_identity() == family.vae_identity()
    assert local.text_identity() == family.text_identity()
    assert (local.fps, local.frame_rule, local.pixel_multiple, local.flow_shift) == (16.0, (4, 1), 16, 3.0)
    assert local.sample_kwargs(SampleConfig(frames=10, steps=2, guidance_scale=5.0))["num_frames"] == 9


@pytest.mark.parametrize("name", ["wan2.1-t2v-1.3b", "wan2.2-ti2v-5b", "wan2.2-t2v-a14b"])
def test_published_wan_sizes_on_meta(name):
    spec = PUBLISHED[name]
    count = sum(x.numel() for x in spec.build_meta().parameters())
    assert spec.family == "wan" and spec.params_match(count), (name, count)
    assert round(count / 1e9, 2) == {"wan2.1-t2v-1.3b": 1.42, "wan2.2-ti2v-5b": 5.0, "wan2.2-t2v-a14b": 14.29}[name]


# -- Wan 2.2 ----------------------------------------------------------------------------------
def test_wan22_5b_trains_on_48_channel_windows_and_loads_in_the_stock_pipeline(wan22_5b_run):
    cfg, p = wan22_5b_run
    family = get_family(cfg.model)
    items = sorted(read_spec(p.latent_spec("s0000"))["items"], key=lambda it: it["id"])
    # The 11-frame clip gives two non-overlapping 5-frame windows (two items), the 7-frame clip one.
    assert sorted(len(it["frames"]) for it in items) == [5, 5, 5] and len({it["item"] for it in items}) == 2
    long = [it for it in items if "/long/" in it["path"]]
    assert [it["frames"] for it in long] == [[0, 1, 2, 3, 4], [6, 7, 8, 9, 10]]
    assert long[1]["id"] == long[0]["id"] + "#w1"
    ds = CachedDataset.from_run(p)
    assert {tuple(ds.collate([i])["latents"].shape[1:]) for i in range(len(ds))} == {(48, 2, 2, 2)}  # 16x VAE
    pipe = family.load_pipeline()
    assert pipe.config.expand_timesteps and family.pixel_multiple == 32
    batch = ds.collate([0, 1])
    base = _denoiser_output(family, pipe.transformer, batch)
    pipe.load_lora_weights(str(p.export_diffusers))
    loaded = _denoiser_output(family, pipe.transformer, batch)
    expected = _denoiser_output(family, apply_adapter(family.load_denoiser(), p.adapter_dir), batch)
    assert (loaded - base).abs().max() > 1e-5, "the LoRA does not change the output"
    torch.testing.assert_close(loaded, expected, rtol=1e-5, atol=1e-5)
    with av.open(str(p.samples_dir / "sample-00.mp4")) as container:
        frames = list(container.decode(video=0))
    assert len(frames) == 5 and (frames[0].width, frames[0].height) == (32, 32)


def test_a14b_low_expert_lora_loads_into_transformer_2(a14b_low_run):
    cfg, p = a14b_low_run
    family = get_family(cfg.model)
    assert family.denoiser_attr == "transformer_2"
    ds = CachedDataset.from_run(p)
    batch = ds.collate([0, 1])
    pipe = family.load_pipeline()
    assert pipe.config.boundary_ratio == 0.875 and pipe.transformer_2 is not None
    high_before = _denoiser_output(family, pipe.transformer, batch)
    base = _denoiser_output(family, pipe.transformer_2, batch)
    pipe.load_lora_weights(str(p.export_diffusers), load_into_transformer_2=True)  # the stock call
    loaded = _denoiser_output(family, pipe.transformer_2, batch)
    expected = _denoiser_output(family, apply_adapter(family.load_denoiser(), p.adapter_dir), batch)
    assert (loaded - base).abs().max() > 1e-5, "the LoRA does not change the low expert"
    torch.testing.assert_close(loaded, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_denoiser_output(family, pipe.transformer, batch), high_before)  # high untouched
    assert "load_into_transformer_2=True" in (p.export_dir / "README.md").read_text()
    assert (p.samples_dir / "sample-00.mp4").exists()


@pytest.mark.parametrize("expert", ["high", "low"])
def test_a14b_expert_trains_only_on_its_timesteps(expert):
    family = get_family(ModelConfig(family="wan", variant="2.2-a14b", expert=expert))
    gen = torch.Generator().manual_seed(0)
    for o in (ObjectiveConfig(), ObjectiveConfig(timestep_sampling="uniform", shift=1.0)):
        sigma = family._sigmas(o, 4096, gen, None)
        inside = sigma >= 0.875 if expert == "high" else sigma < 0.875
        assert inside.all() and sigma.max() - sigma.min() > 0.05, (expert, o)
    quantiles = family._sigmas(ObjectiveConfig(), 2, gen, torch.tensor([0.01, 0.99]))  # eval: the expert's range
    assert ((quantiles >= 0.875) if expert == "high" else (quantiles < 0.875)).all()
    with pytest.raises(ValueError, match="do not overlap the high expert"):
        get_family(ModelConfig(family="wan", variant="2.2-a14b", expert="high"))._sigmas(
            ObjectiveConfig(max_timestep=0.2), 2, gen, None
        )


def test_variant_and_expert_errors_and_local_detection(tmp_path):
    with pytest.raises(ValueError, match=r"model.expert: Wan 2.2 A14B \(variant 2.2-a14b\) has two experts"):
        get_family(ModelConfig(family="wan", variant="2.2-a14b"))
    with pytest.raises(ValueError, match="only Wan 2.2 A14B"):
        get_family(ModelConfig(family="wan", expert="high"))
    with pytest.raises(ValueError, match="model.variant '2.3'"):
        get_family(ModelConfig(family="wan", variant="2.3"))
    with pytest.raises(ValueError, match="family 'sd' has variants: none"):
        get_family(ModelConfig(family="sd", variant="2.1"))
    tiny = get_family(ModelConfig(family="wan", variant="2.2-a14b", expert="low"))
    tiny.load_pipeline().save_pretrained(tmp_path)
    assert detect_variant(tmp_path) == "2.2-a14b"
    local = get_family(ModelConfig(family="wan", flavor="local", path=str(tmp_path), expert="low"))
    assert (local.variant, local.boundary_ratio, local.denoiser_attr) == ("2.2-a14b", 0.875, "transformer_2")
    assert local.vae_identity() == tiny.vae_identity()
    with pytest.raises(ValueError, match="holds Wan 2.2-a14b"):
        get_family(ModelConfig(family="wan", flavor="local", path=str(tmp_path), variant="2.1"))


# -- Wan 2.2 A14B, both experts in one run -------------------------------------------------------
EXPERTS = {"transformer": {}, "transformer_2": {"load_into_transformer_2": True}}


def _lora_parts(adapter_dir) -> dict[str, dict[str, torch.Tensor]]:
    sd, _ = load_adapter(adapter_dir)
    return {e: {k.removeprefix(f"{e}."): v for k, v in sd.items() if k.startswith(f"{e}.")} for e in EXPERTS}


def test_a14b_both_trains_a_lora_on_each_expert_routed_by_timestep(a14b_both_run):
    cfg, p = a14b_both_run
    family = get_family(cfg.model)
    parts = _lora_parts(p.adapter_dir)
    assert len(parts["transformer"]) == len(parts["transformer_2"]) == len(load_adapter(p.adapter_dir)[0]) // 2
    for expert, sd in parts.items():  # lora_B starts at zero: nonzero means the expert was updated
        assert max(float(v.abs().max()) for k, v in sd.items() if "lora_B" in k) > 0, expert
    pair = apply_adapter(family.load_denoiser(), p.adapter_dir).eval()
    batch = CachedDataset.from_run(p).collate([0, 1])
    # t = 0.1 -> sigma 0.57 (below the 0.875 boundary: low expert); t = 0.9 -> sigma 0.99 (high expert).
    t, noise = torch.tensor([0.1, 0.9]), torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(0))
    seen = {e: [] for e in EXPERTS}
    hooks = [getattr(pair, e).register_forward_pre_hook(lambda m, a, e=e: seen[e].append(a[1])) for e in EXPERTS]
    with torch.no_grad():
        both = family.loss(pair, batch["latents"], batch["text"], torch.Generator(), t=t, noise=noise)
    for h in hooks:
        h.remove()
    assert [x.tolist() for x in seen["transformer"]] == [[pytest.approx(1000 * 10.8 / 10.9, rel=1e-5)]]
    assert [x.tolist() for x in seen["transformer_2"]] == [[pytest.approx(1000 * 1.2 / 2.1, rel=1e-5)]]
    with torch.no_grad():  # each sample's loss is exactly its expert's alone
        high = family.loss(pair.transformer, batch["latents"], batch["text"], torch.Generator(), t=t, noise=noise)
        low = family.loss(pair.transformer_2, batch["latents"], batch["text"], torch.Generator(), t=t, noise=noise)
    torch.testing.assert_close(both, torch.stack([low[0], high[1]]))
    assert (high - low).abs().min() > 1e-6  # the experts really differ
    with pytest.raises(ValueError, match="model.expert both: pipeline parallelism"):
        family.pipeline_layers(pair)


def test_a14b_both_exports_load_into_each_expert_of_the_stock_pipeline(a14b_both_run):
    cfg, p = a14b_both_run
    family = get_family(cfg.model)
    files = {"transformer": p.export_diffusers, "transformer_2": p.export_file("diffusers", "_low_noise")}
    assert files["transformer_2"].name == "pytorch_lora_weights_low_noise.safetensors"
    batch = CachedDataset.from_run(p).collate([0, 1])
    pipe = family.load_pipeline()
    base = {e: _denoiser_output(family, getattr(pipe, e), batch) for e in EXPERTS}
    for expert, kwargs in EXPERTS.items():
        pipe.load_lora_weights(str(files[expert]), **kwargs)  # the stock calls, as the model card shows
    pair = apply_adapter(family.load_denoiser(), p.adapter_dir)
    for expert in EXPERTS:
        loaded = _denoiser_output(family, getattr(pipe, expert), batch)
        assert (loaded - base[expert]).abs().max() > 1e-5, f"the LoRA does not change {expert}"
        torch.testing.assert_close(loaded, _denoiser_output(family, getattr(pair, expert), batch), rtol=1e-5, atol=1e-5)
    card = (p.export_dir / "README.md").read_text()
    assert 'load_lora_weights("pytorch_lora_weights.safetensors")' in card
    assert 'load_lora_weights("pytorch_lora_weights_low_noise.safetensors", load_into_transformer_2=True)' in card
    # PEFT: one folder per expert, keys relative to it; merged: each expert = base + its own LoRA.
    parts, scale = _lora_parts(p.adapter_dir), cfg.train.lora.alpha / cfg.train.lora.rank
    fresh = family.load_pipeline()
    for expert, folder in {"transformer": p.export_file("peft"), "transformer_2": p.export_file("peft", "_low_noise")}.items():
        sd, _ = load_adapter(folder)
        assert sd.keys() == parts[expert].keys() and all(torch.equal(sd[k], parts[expert][k]) for k in sd)
        merged = WanTransformer3DModel.from_pretrained(p.export_file("merged") / expert).state_dict()
        base_sd = getattr(fresh, expert).state_dict()
        for key in (k for k in sd if ".lora_A." in k):
            module = key.split(".lora_A.")[0]
            delta = scale * sd[key.replace("lora_A", "lora_B")] @ sd[key]
            torch.testing.assert_close(merged[f"{module}.weight"], base_sd[f"{module}.weight"] + delta)
    with av.open(str(p.samples_dir / "sample-00.mp4")) as container:
        assert len(list(container.decode(video=0))) == 5


def test_a14b_both_refusals(tmp_path):
    from diffpipe.export import export_lora

    family = get_family(ModelConfig(family="wan", variant="2.2-a14b", expert="both"))
    with pytest.raises(ValueError, match=r"export formats \['comfyui'\]: a run with model.expert both"):
        export_lora(tmp_path / "adapter", tmp_path / "out", family, ["diffusers", "comfyui"])
