"""Incremental caching with the tiny sd family: counts of encodes, reuse, kills, corruption.

Each test builds a small dataset, plans it and runs the cache jobs the way
Snakemake would (only for shard specs that changed), then checks the
``encoded`` / ``reused`` counts of the job summaries.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image

from diffpipe.cache_jobs import cache_empty_text, cache_latents, cache_text
from diffpipe.config import CacheConfig, DatasetConfig, ModelConfig, ValidationConfig
from diffpipe.data.cache.latents import LatentShard
from diffpipe.data.cache.plan import make_plan
from diffpipe.data.cache.reader import CachedDataset
from diffpipe.data.dataset.demo import write_demo_dataset
from diffpipe.data.dataset.validate import run_validation
from diffpipe.families import get_family
from diffpipe.paths import RunPaths
from diffpipe.utils import OUTPUT_MARKER

MODEL = ModelConfig(family="sd")


@pytest.fixture(scope="module")
def family():
    return get_family(MODEL)


class Run:
    """A dataset folder, a run folder, and the cache jobs Snakemake would run."""

    def __init__(self, root: Path, family, *, n=12, store=None, cache=None, **ds):
        self.data = root / "data"
        if not self.data.exists():
            write_demo_dataset(self.data, n=n, size=64)
        self.paths = RunPaths(root / "run")
        self.family = family
        self.cache = cache or CacheConfig(
            shards=3, batch_size=4, workers=0, dir=str(store) if store else None
        )
        self.ds = {"name": "demo", "path": str(self.data), **ds}
        self.specs: dict[Path, bytes] = {}

    def datasets(self):
        return [DatasetConfig(**self.ds)]

    def plan(self, **ids):
        p = self.paths
        run_validation(
            self.datasets(),
            ValidationConfig(),
            manifest_path=p.manifest,
            report_json=p.report_json,
            report_html=p.report_html,
        )
        kw = {
            "latent_identity": self.family.vae_identity(),
            "text_identity": self.family.text_identity(),
            **ids,
        }
        return make_plan(
            p.manifest,
            self.datasets(),
            self.cache,
            pixel_multiple=self.family.pixel_multiple,
            paths=p,
            global_batch=4,
            **kw,
        )

    def cache_changed(self, *, force=False, **kw) -> dict[str, list[dict]]:
        """Run the jobs whose spec changed (or all with ``force``); their summaries by kind."""
        out: dict[str, list[dict]] = {"latents": [], "text": []}
        p = self.paths
        for s in p.shard_names():
            for kind, spec, target, fn in (
                ("latents", p.latent_spec(s), p.latent_shard(s), cache_latents),
                ("text", p.text_spec(s), p.text_shard(s), cache_text),
            ):
                data = spec.read_bytes()
                if force or self.specs.get(spec) != data or not target.exists():
                    if target.is_dir():  # Snakemake deletes a job's outputs before it runs
                        shutil.rmtree(target)
                    kwargs = (
                        dict(kw)
                        if kind == "latents"
                        else {k: v for k, v in kw.items() if k != "trust"}
                    )
                    out[kind].append(fn(spec, target, MODEL, self.cache, **kwargs))
                    self.specs[spec] = data
        return out


def _sum(summaries, field):
    return sum(s[field] for s in summaries)


def _add_images(data: Path, k: int, start=0):
    for i in range(start, start + k):
        Image.new("RGB", (96, 64), (10 * i % 255, 100, 200)).save(data / f"new_{i:03d}.png")
        (data / f"new_{i:03d}.txt").write_text(f"new picture number {i}")


def _latents_by_id(paths: RunPaths) -> dict[str, bytes]:
    out = {}
    for s in paths.shard_names():
        shard = LatentShard(paths.latent_shard(s))
        for name, meta in shard.meta.items():
            raw = shard.read_raw(name)
            out.update({i: raw[r].tobytes() for r, i in enumerate(meta["ids"])})
    return out


def test_additions_encode_only_the_new_items(tmp_path, family):
    run = Run(
        tmp_path, family, cache=CacheConfig(shards=3, batch_size=4, workers=0, dtype="bfloat16")
    )
    run.plan()
    first = run.cache_changed()
    before = _latents_by_id(run.paths)
    assert _sum(first["latents"], "encoded") == 12 and _sum(first["text"], "encoded") == 12
    empty = cache_empty_text(run.paths.text_empty, MODEL, run.cache, spec_path=run.paths.empty_spec)
    assert empty["encoded"] == 1
    again = cache_empty_text(run.paths.text_empty, MODEL, run.cache, spec_path=run.paths.empty_spec)
    assert again["encoded"] == 0 and again["reused"] == 1  # the empty caption is encoded once

    _add_images(run.data, 3)
    run.plan()
    second = run.cache_changed()
    assert _sum(second["latents"], "encoded") == 3 and _sum(second["text"], "encoded") == 3
    rebuilt = sum(s["items"] for s in second["latents"])
    assert (
        _sum(second["latents"], "reused") == rebuilt - 3
    )  # the rest of the touched shards: copied
    ds = CachedDataset.from_run(run.paths)
    assert len(ds) == 15 and ds.empty_text is not None
    after = _latents_by_id(run.paths)
    assert all(after[i] == b for i, b in before.items())  # copied rows are bit-exact (bf16 bits)

    # Nothing changed: no spec changes, so no job would run.
    run.plan()
    assert run.cache_changed() == {"latents": [], "text": []}

    # A deletion rebuilds one shard from the store: nothing is encoded.
    (run.data / "new_001.png").unlink()
    (run.data / "new_001.txt").unlink()
    run.plan()
    third = run.cache_changed()
    assert len(third["latents"]) == 1 and _sum(third["latents"], "encoded") == 0
    assert len(CachedDataset.from_run(run.paths)) == 14


def test_caption_edit_encodes_one_caption_and_no_latents(tmp_path, family):
    run = Run(tmp_path, family)
    run.plan()
    run.cache_changed()
    (run.data / "shape_004.txt").write_text("a purple star on a grey background\n")
    run.plan()
    jobs = run.cache_changed()
    assert jobs["latents"] == []  # no latent spec changed
    assert len(jobs["text"]) == 1 and jobs["text"][0]["encoded"] == 1
    assert jobs["text"][0]["reused"] == jobs["text"][0]["items"] - 1
    # Even forced, the latent jobs find every key in the store.
    forced = run.cache_changed(force=True)
    assert _sum(forced["latents"], "encoded") == 0 and _sum(forced["text"], "encoded") == 0
    assert _sum(forced["latents"], "reused") == 12


def test_new_resolution_encodes_only_that_resolution(tmp_path, family):
    run = Run(tmp_path, family, resolution=64)
    run.plan()
    run.cache_changed()
    run.ds["resolutions"] = [64, 96]
    run.plan()
    jobs = run.cache_changed()
    assert _sum(jobs["latents"], "encoded") == 12 and _sum(jobs["latents"], "reused") == 12
    assert jobs["text"] == []
    ds = CachedDataset.from_run(run.paths)
    assert len(ds) == 24 and set(ds.summary()["buckets"]) == {"1x64x64", "1x96x96"}


def test_runs_sharing_a_store_share_entries_and_vae_change_rekeys_latents_only(tmp_path, family):
    store = tmp_path / "shared-store"
    a = Run(tmp_path / "a", family, store=store)
    a.plan()
    a.cache_changed()
    shutil.copytree(a.data, tmp_path / "b" / "data")
    b = Run(tmp_path / "b", family, store=store, caption_prefix="")
    b.cache = CacheConfig(shards=5, batch_size=4, workers=0, dir=str(store))  # another shard layout
    b.plan()
    jobs = b.cache_changed()
    assert _sum(jobs["latents"], "encoded") == 0 and _sum(jobs["latents"], "reused") == 12
    assert _sum(jobs["text"], "encoded") == 0

    # Another VAE identity: every latent spec changes, no text spec does.
    before = {p: p.read_bytes() for p in b.paths.plan_dir.rglob("*.json") if p.name != OUTPUT_MARKER}
    b.plan(latent_identity="another-vae")
    changed = sorted(
        p.relative_to(b.paths.plan_dir).as_posix() for p, d in before.items() if p.read_bytes() != d
    )
    assert all(c.startswith("latents/") or c == "plan.json" for c in changed)
    assert any(c.startswith("latents/") for c in changed)


def test_regenerate_and_trust(tmp_path, family):
    run = Run(tmp_path, family)
    run.plan()
    run.cache_changed()
    again = run.cache_changed(force=True, regenerate=True)
    assert _sum(again["latents"], "encoded") == 12 and _sum(again["latents"], "reused") == 0
    assert _sum(again["text"], "encoded") == 12

    # A file changed after validation: refused, unless trusted.
    img = run.data / "shape_000.png"
    img.write_bytes(img.read_bytes() + b"\0")
    with pytest.raises(ValueError, match="changed since validation"):
        run.cache_changed(force=True, regenerate=True)
    trusted = run.cache_changed(force=True, regenerate=True, trust=True)
    assert _sum(trusted["latents"], "encoded") == 12


def test_decoding_in_worker_processes_gives_the_same_shard(tmp_path, family):
    inline = Run(tmp_path / "a", family, cache=CacheConfig(shards=1, batch_size=2, workers=0))
    inline.plan()
    inline.cache_changed()
    shutil.copytree(inline.data, tmp_path / "b" / "data")
    procs = Run(tmp_path / "b", family, cache=CacheConfig(shards=1, batch_size=2, workers=1))
    procs.plan()
    (summary,) = procs.cache_changed()["latents"]
    assert summary["encoded"] == 12
    a, b = (
        LatentShard(inline.paths.latent_shard("s0000")),
        LatentShard(procs.paths.latent_shard("s0000")),
    )
    assert a.attrs["checksum"] == b.attrs["checksum"]


def test_corrupt_store_entry_is_detected_and_re_encoded(tmp_path, family):
    run = Run(tmp_path, family)
    run.plan()
    run.cache_changed()
    shard = run.paths.latent_shard("s0001")
    chunk = next(p for p in (shard / "1x64x64").rglob("*") if p.is_file() and p.name != "zarr.json")
    data = bytearray(chunk.read_bytes())
    data[11] ^= 0x10
    chunk.write_bytes(bytes(data))  # the run's shard is a hard link: the store entry is damaged too
    with pytest.raises(ValueError, match=r"latents/s0001\.zarr is corrupt"):
        CachedDataset.from_run(run.paths)
    n = LatentShard(shard).shape("1x64x64")[0]
    jobs = run.cache_changed(force=True)
    assert _sum(jobs["latents"], "encoded") == n  # the damaged store shard was discarded
    assert len(CachedDataset.from_run(run.paths)) == 12


def _tree(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        # Markers record each file's modification time (#38): not content.
        if p.is_file() and ".tmp-" not in p.as_posix() and not p.name.endswith(".summary.json")
        and p.name != OUTPUT_MARKER
    }


def test_killed_cache_job_then_rerun_is_byte_identical(tmp_path, family):
    reference = Run(
        tmp_path / "ref", family, n=16, cache=CacheConfig(shards=1, batch_size=2, workers=0)
    )
    reference.plan()
    reference.cache_changed()

    shutil.copytree(reference.data, tmp_path / "kill" / "data")
    run = Run(tmp_path / "kill", family, cache=reference.cache)
    run.plan()
    cfg = tmp_path / "kill" / "config.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "output_dir": str(run.paths.root),
                "datasets": [run.ds],
                "cache": run.cache.model_dump(mode="json"),
            }
        )
    )
    cmd = [sys.executable, "-m", "diffpipe", "cache", "latents", "-c", str(cfg), "--shard", "s0000"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    seed = int.from_bytes(os.urandom(4), "big")
    delay = random.Random(seed).uniform(
        0.5, 6.0
    )  # from start-up to after the write (about 4 s here)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    print(f"killed after {delay:.2f} s (seed {seed})")
    if run.paths.latent_shard("s0000").exists():
        # A finished shard can only appear complete: it must verify.
        assert LatentShard(run.paths.latent_shard("s0000")).verify()
    shutil.rmtree(
        run.paths.latent_shard("s0000"), ignore_errors=True
    )  # Snakemake's rerun deletes it
    run.cache_changed(force=True)
    assert _tree(run.paths.root / "cache") == _tree(reference.paths.root / "cache"), f"seed {seed}"


def test_plan_transforms_flip_random_crop_and_underfilled_buckets(tmp_path, family):
    run = Run(tmp_path, family, flip=True, crop="random")
    Image.new("RGB", (128, 64), (1, 2, 3)).save(run.data / "wide.png")
    (run.data / "wide.txt").write_text("a wide picture")
    result = run.plan()
    assert result.items == 13 and result.entries == 26
    specs = [json.loads(run.paths.latent_spec(s).read_text()) for s in run.paths.shard_names()]
    entries = [e for spec in specs for e in spec["items"]]
    flips = [e for e in entries if e["flip"]]
    assert len(flips) == 13 and all(e["id"].endswith(":flip") for e in flips)
    assert len({e["key"] for e in entries}) == 26  # flip and crop are part of the key
    assert (
        all(0 <= c <= 1 for e in entries for c in e["crop"])
        and len({tuple(e["crop"]) for e in entries}) > 2
    )
    summary = json.loads(run.paths.plan_summary.read_text())
    wide = next(b for b in summary["buckets"] if b != "1x64x64")
    assert summary["underfilled_buckets"] == {wide: 2}  # 2 samples < a global batch of 4, reported
    jobs = run.cache_changed()
    assert _sum(jobs["latents"], "encoded") == 26
    ds = CachedDataset.from_run(run.paths)
    lat = {it.id: ds.collate([i])["latents"] for i, it in enumerate(ds.items)}
    some = next(i for i in lat if not i.endswith(":flip") and f"{i}:flip" in lat)
    assert not torch.equal(lat[some], lat[f"{some}:flip"])
    # The plan is stable: random crops come from the content hash, not a clock.
    before = {p: p.read_bytes() for p in run.paths.plan_dir.rglob("*.json")}
    assert run.plan().written == [] and all(p.read_bytes() == d for p, d in before.items())
    assert torch.isfinite(ds.collate(ds.epoch_batches(0, 4, 0)[0])["latents"]).all()
