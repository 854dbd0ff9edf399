"""The Wan 2.1 t2v family on its tiny flavor, through every real stage, on clips and images.

validate → plan → cache latents/text on a mixed dataset (short moving-shape
clips + images) → 2 DeepSpeed steps → diffusers export → the stock
``WanPipeline.load_lora_weights``: the transformer's output changes and
equals the trained adapter's → sampling writes MP4 clips. Run in-process
through the real Typer app, as in ``test_image_families.py``.
"""

from __future__ import annotations

import av
import pytest
import torch
import yaml
from typer.testing import CliRunner

from diffpipe.cli import app
from diffpipe.config import ModelConfig, SampleConfig, load_config
from diffpipe.data.demo import write_demo_dataset
from diffpipe.data.demo_video import write_demo_clips
from diffpipe.data.plan import read_spec
from diffpipe.data.reader import CachedDataset
from diffpipe.models import get_family
from diffpipe.models.published import PUBLISHED
from diffpipe.paths import RunPaths
from diffpipe.training.adapter import apply_adapter
from diffpipe.training.engine import free_port

pytestmark = pytest.mark.slow


def _cli(*args, cwd, monkeypatch):
    monkeypatch.chdir(cwd)
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, f"diffpipe {' '.join(args)} failed:\n{result.output}\n{result.exception!r}"
    return result


@pytest.fixture(scope="module")
def wan_run(tmp_path_factory):
    monkeypatch = pytest.MonkeyPatch()
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                           WORLD_SIZE="1", LOCAL_RANK="0").items():
        monkeypatch.setenv(key, value)
    root = tmp_path_factory.mktemp("wan")
    data = root / "data"
    write_demo_dataset(data, n=2, size=32)
    write_demo_clips(data, n=2, frames=7, width=48, height=32, fps=16)
    cfg = {
        "output_dir": "run",
        "model": {"family": "wan", "flavor": "tiny"},
        "datasets": [{"name": "mixed", "path": str(data), "resolution": 32, "frame_buckets": [5]}],
        "cache": {"shards": 1, "workers": 0},
        "train": {"max_steps": 2, "batch_size": 2, "lr": 0.01, "save_every_epochs": 0,
                  "eval": {"quantiles": []}},
        "export": {"formats": ["diffusers", "peft"]},
        "sample": {"prompts": ["a red circle moving left to right"], "steps": 2, "width": 32, "height": 32,
                   "frames": 5},
    }
    config = root / "wan.yaml"
    config.write_text(yaml.safe_dump(cfg))
    c = str(config)
    try:
        _cli("validate", "-c", c, cwd=root, monkeypatch=monkeypatch)
        _cli("plan", "-c", c, cwd=root, monkeypatch=monkeypatch)
        paths = RunPaths(root / "run")
        for shard in paths.shard_names("latents"):
            _cli("cache", "latents", "-c", c, "--shard", shard, cwd=root, monkeypatch=monkeypatch)
            _cli("cache", "text", "-c", c, "--shard", shard, cwd=root, monkeypatch=monkeypatch)
        _cli("cache", "empty", "-c", c, cwd=root, monkeypatch=monkeypatch)
        _cli("train", "-c", c, cwd=root, monkeypatch=monkeypatch)
        _cli("export", "-c", c, cwd=root, monkeypatch=monkeypatch)
        _cli("sample", "-c", c, cwd=root, monkeypatch=monkeypatch)
    finally:
        monkeypatch.undo()
    return load_config(config), paths


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
    sampler = TrainingSampler(family, SampleConfig(prompts=["a"], steps=1, width=32, height=32, frames=5),
                              family.load_denoiser(), tmp_path)
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
            family.loss(denoiser, batch["latents"], batch["text"], torch.Generator(),
                        t=torch.tensor([0.3, 0.7]), noise=noise)
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
    assert local.sample_kwargs(SampleConfig(frames=10))["num_frames"] == 9


def test_published_wan_size_on_meta():
    spec = PUBLISHED["wan2.1-t2v-1.3b"]
    count = sum(x.numel() for x in spec.build_meta().parameters())
    assert abs(count / 1.42e9 - 1) < 0.01, count
