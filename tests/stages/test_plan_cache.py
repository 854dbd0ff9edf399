import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffpipe.cache_jobs import cache_empty_text, cache_latents, cache_text
from diffpipe.config import CacheConfig, DatasetConfig, ModelConfig, ValidationConfig
from diffpipe.data.cache.buckets import choose_bucket, load_image
from diffpipe.data.cache.latents import LatentShard
from diffpipe.data.cache.plan import make_plan, read_spec
from diffpipe.data.cache.reader import CachedDataset
from diffpipe.data.dataset.demo import write_demo_dataset
from diffpipe.data.dataset.validate import run_validation
from diffpipe.paths import RunPaths, shard_name
from diffpipe.utils import OUTPUT_MARKER

DEMO = Path(__file__).resolve().parents[2] / "config" / "demo_data"


def _validate(paths: RunPaths, datasets):
    return run_validation(
        datasets,
        ValidationConfig(),
        manifest_path=paths.manifest,
        report_json=paths.report_json,
        report_html=paths.report_html,
    )


def _plan(paths, datasets, cache_cfg, **ids):
    ident = {"latent_identity": "vae-1", "text_identity": "te-1", **ids}
    return make_plan(paths.manifest, datasets, cache_cfg, pixel_multiple=8, paths=paths, **ident)


def _specs(paths):
    return {
        p.relative_to(paths.plan_dir).as_posix(): p.read_bytes()
        for p in paths.plan_dir.rglob("*.json")
        if p.name != OUTPUT_MARKER  # the plan's record of what it wrote (#38)
    }


def _changed(before, after):
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


@pytest.fixture
def planned(tmp_path):
    data = tmp_path / "data"
    write_demo_dataset(data, n=12, size=64)
    datasets = [DatasetConfig(name="demo", path=str(data), caption_prefix="sks", repeats=2)]
    paths = RunPaths(tmp_path / "run")
    cache_cfg = CacheConfig(shards=4)
    _validate(paths, datasets)
    _plan(paths, datasets, cache_cfg)
    return data, datasets, paths, cache_cfg


def test_plan_is_stable_and_complete(planned):
    data, datasets, paths, cache_cfg = planned
    before = _specs(paths)
    assert sorted(before) == sorted(
        [f"latents/{shard_name(i)}.json" for i in range(4)]
        + [f"text/{shard_name(i)}.json" for i in range(4)]
        + ["plan.json", "empty.json"]
    )
    result = _plan(paths, datasets, cache_cfg)
    assert result.written == [] and _specs(paths) == before and result.items == 12
    items = [it for s in result.shards for it in read_spec(paths.latent_spec(s))["items"]]
    assert len(items) == 12 and all(
        it["repeats"] == 2 and it["bucket"] == [1, 64, 64] for it in items
    )
    text = read_spec(paths.text_spec("s0000"))
    assert text["identity"] == "te-1" and all(
        it["caption"].startswith("sks a ") for it in text["items"]
    )
    summary = json.loads(paths.plan_summary.read_text())
    assert summary["items"] == 12 and sum(s["items"] for s in summary["shards"].values()) == 12


def test_caption_edit_changes_one_text_spec_only(planned):
    data, datasets, paths, cache_cfg = planned
    before = _specs(paths)
    (data / "shape_005.txt").write_text("a purple star on a grey background\n")
    _validate(paths, datasets)
    _plan(paths, datasets, cache_cfg)
    changed = _changed(before, _specs(paths))
    assert len(changed) == 1 and changed[0].startswith("text/")


def test_added_image_changes_one_latent_spec(planned):
    data, datasets, paths, cache_cfg = planned
    before = _specs(paths)
    Image.new("RGB", (64, 32), (1, 2, 3)).save(data / "wide.png")
    (data / "wide.txt").write_text("a wide picture")
    _validate(paths, datasets)
    _plan(paths, datasets, cache_cfg)
    changed = _changed(before, _specs(paths))
    assert len([c for c in changed if c.startswith("latents/")]) == 1
    assert len([c for c in changed if c.startswith("text/")]) == 1
    assert "plan.json" in changed  # counts per bucket changed


def test_model_change_rekeys_and_fewer_shards_remove_specs(planned):
    data, datasets, paths, cache_cfg = planned
    before = _specs(paths)
    _plan(paths, datasets, cache_cfg, text_identity="te-2")
    assert all(c.startswith("text/") or c == "empty.json" for c in _changed(before, _specs(paths)))
    result = _plan(paths, datasets, CacheConfig(shards=2))
    removed = sorted(p.relative_to(paths.plan_dir).as_posix() for p in result.removed)
    assert removed == [
        "latents/s0002.json",
        "latents/s0003.json",
        "text/s0002.json",
        "text/s0003.json",
    ]
    assert paths.shard_names("latents") == paths.shard_names("text") == ["s0000", "s0001"]


# -- with the real tiny sd family ---------------------------------------------------


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    from diffpipe.families import get_family

    root = tmp_path_factory.mktemp("cache")
    data = root / "data"
    shutil.copytree(DEMO, data)
    Image.new("RGB", (96, 48), (200, 10, 10)).save(data / "wide_a.png")
    (data / "wide_a.txt").write_text("a red rectangle")
    Image.new("RGB", (96, 48), (10, 10, 200)).save(data / "wide_b.png")
    (data / "wide_b.txt").write_text("a blue rectangle")
    model_cfg = ModelConfig(family="sd")
    cache_cfg = CacheConfig(shards=2, batch_size=4, dtype="bfloat16")
    datasets = [DatasetConfig(name="demo", path=str(data), resolution=64)]
    paths = RunPaths(root / "run")
    family = get_family(model_cfg)
    assert _validate(paths, datasets).kept == 18
    make_plan(
        paths.manifest,
        datasets,
        cache_cfg,
        latent_identity=family.vae_identity(),
        text_identity=family.text_identity(),
        pixel_multiple=family.pixel_multiple,
        paths=paths,
    )
    summaries = []
    for s in paths.shard_names():
        summaries.append(
            cache_latents(paths.latent_spec(s), paths.latent_shard(s), model_cfg, cache_cfg)
        )
        summaries.append(cache_text(paths.text_spec(s), paths.text_shard(s), model_cfg, cache_cfg))
    cache_empty_text(paths.text_empty, model_cfg, cache_cfg)
    return paths, family, model_cfg, cache_cfg, summaries


def test_cached_dataset_batches(cached):
    paths, family, _, _, summaries = cached
    assert sum(s["encoded"] for s in summaries if s["kind"] == "latents") == 18
    assert all(Path(f"{paths.latent_shard(s)}.summary.json").is_file() for s in paths.shard_names())
    ds = CachedDataset.from_run(paths)
    summary = ds.summary()
    wide_h, wide_w = choose_bucket(96, 48, 64, family.pixel_multiple)
    wide_name = f"1x{wide_h}x{wide_w}"
    assert len(ds) == 18 and summary["buckets"] == {wide_name: 2, "1x64x64": 16}
    assert summary["latent_shapes"]["1x64x64"] == [4, 1, 32, 32]

    batches = ds.epoch_batches(0, 4, seed=1)
    assert batches == ds.epoch_batches(0, 4, seed=1) != ds.epoch_batches(1, 4, seed=1)
    assert len(batches) == ds.num_batches(4) == 4 + 1  # the 2-item bucket is filled, not dropped
    assert all(len(b) == 4 for b in batches)
    assert {i for b in batches for i in b} == set(range(18))
    wide = next(b for b in batches if ds.items[b[0]].bucket == wide_name)
    batch = ds.collate(wide)
    factor = 64 // summary["latent_shapes"]["1x64x64"][-1]
    assert (
        batch["latents"].shape == (4, 4, 1, wide_h // factor, wide_w // factor)
        and batch["latents"].dtype == torch.float32
    )
    assert batch["text"]["prompt_embeds"].shape == (4, 77, 32)
    assert set(batch["ids"]) == {ds.items[i].id for i in wide}
    assert ds.empty_text["prompt_embeds"].shape == (1, 77, 32)

    # Stored latents equal a direct encode of the same image.
    item = ds.items[batches[0][0]]
    h, w = map(int, item.bucket.split("x")[1:])
    with torch.no_grad():
        direct = family.encode_pixels(family.load_vae(), load_image(item.path, (h, w))[None])
    got = ds.collate([batches[0][0]])["latents"]
    # (batched and single encodes differ in float rounding, so compare at bf16 precision)
    assert torch.allclose(got, direct, rtol=1e-2, atol=1e-3)
    with pytest.raises(ValueError, match="one bucket"):
        ds.collate([wide[0], next(i for i in range(18) if ds.items[i].bucket == "1x64x64")])


def test_corrupt_or_missing_cache_is_named(cached, tmp_path):
    paths, *_ = cached
    run = RunPaths(tmp_path / "run")
    shutil.copytree(paths.root, run.root)
    shard = run.latent_shard("s0001")
    chunk = next(p for p in (shard / "1x64x64").rglob("*") if p.is_file() and p.name != "zarr.json")
    data = bytearray(chunk.read_bytes())
    data[7] ^= 0x40
    chunk.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"latents/s0001\.zarr is corrupt"):
        CachedDataset.from_run(run)
    shutil.rmtree(shard)
    with pytest.raises(ValueError, match=r"latents/s0001\.zarr is missing"):
        CachedDataset.from_run(run)
    shutil.copytree(paths.latent_shard("s0001"), shard)

    # A spec whose key the shard lacks (a stale shard): the error names file and key.
    spec = json.loads(run.latent_spec("s0000").read_text())
    spec["items"][0]["key"] = "0" * 64
    run.latent_spec("s0000").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"s0000\.zarr has no entry for .*\.png \(key 0{64}"):
        CachedDataset.from_run(run)


def test_cache_refuses_changed_file_or_other_model(cached, tmp_path):
    paths, _, model_cfg, cache_cfg, _ = cached
    spec = read_spec(paths.latent_spec("s0000"))
    src = Path(spec["items"][0]["path"])
    copy = tmp_path / src.name
    copy.write_bytes(src.read_bytes() + b"\0")
    spec["items"] = [dict(spec["items"][0], path=str(copy))]
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="changed since validation"):
        cache_latents(spec_path, tmp_path / "x.zarr", model_cfg, cache_cfg)
    with pytest.raises(ValueError, match="another model"):
        cache_latents(
            spec_path, tmp_path / "x.zarr", model_cfg.model_copy(update={"seed": 1}), cache_cfg
        )
    assert not (tmp_path / "x.zarr").exists()


def test_empty_shard_round_trip(tmp_path, cached):
    source, _, model_cfg, cache_cfg, _ = cached
    paths = RunPaths(tmp_path)
    spec = read_spec(source.latent_spec("s0000"))
    spec["items"] = []
    paths.latent_spec("s0000").parent.mkdir(parents=True)
    paths.latent_spec("s0000").write_text(json.dumps(spec))
    summary = cache_latents(
        paths.latent_spec("s0000"), paths.latent_shard("s0000"), model_cfg, cache_cfg
    )
    assert summary["encoded"] == 0 and LatentShard(paths.latent_shard("s0000")).names == []
    assert np.isfinite(summary["wall_s"])


def test_fp8_text_encoders_rekey_and_encode_the_text_cache(cached, tmp_path):
    """``model.text_encoder_weights: fp8`` is in the text key: a spec planned without it is refused by the
    fp8 cache job; planned with it, the job encodes every caption with float8-stored encoders (close to,
    not equal to, the float32 shard's embeddings)."""
    from diffpipe.data.cache.text import TextShard
    from diffpipe.families import get_family

    paths, _, model_cfg, cache_cfg, _ = cached
    fp8 = model_cfg.model_copy(update={"text_encoder_weights": "fp8"})
    with pytest.raises(ValueError, match="another model"):
        cache_text(paths.text_spec("s0000"), tmp_path / "refused", fp8, cache_cfg)
    spec = read_spec(paths.text_spec("s0000"))
    spec["identity"] = get_family(fp8).text_identity()
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    summary = cache_text(spec_path, tmp_path / "text", fp8, cache_cfg, store=tmp_path / "store")
    assert summary["encoded"] == len(spec["items"]) > 0
    ours, plain = TextShard(tmp_path / "text").tensors(), TextShard(paths.text_shard("s0000")).tensors()
    assert ours.keys() == plain.keys()
    for key, value in plain.items():
        rel = ((ours[key].float() - value.float()).norm() / value.float().norm()).item()
        assert 0 < rel < 0.2, f"{key}: relative error {rel:.3f}"
