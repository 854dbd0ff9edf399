"""Incremental caching: full cache, +10 images, one caption edit, encoder-only time, reader speed.

Usage (figures in docs/benchmarks.md, "Benchmarks"):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cache_incremental.py --n 1000 [--shards 8] [--dir /tmp/cb]

Runs the cache jobs in process, one call per shard spec that changed (what
Snakemake reruns), with the tiny SD family on N generated images of mixed
aspect ratios. Reports:

- full caching wall time (sum of job wall times, encoder loading included);
- adding 10 images: wall time of the rebuilt jobs, as a fraction of the
  full time (target <= 3 %), and the encode count (target exactly 10);
- editing one caption: text and latent encode counts (targets 1 and 0);
- the latent stage's wall time over the pure encoder calls on pre-decoded
  tensors, same batches (target <= 1.15);
- reader: batches per second from ``CachedDataset`` vs tiny-model LoRA
  training steps per second (target >= 50x), and Zarr reads per row vs in
  blocks (why a shard's bucket is read in one call).
"""

from __future__ import annotations

import argparse
import io
import json
import random
import shutil
import time
from pathlib import Path

import torch

from diffpipe.cache_jobs import cache_latents, cache_text
from diffpipe.config import CacheConfig, DatasetConfig, LoraConfig, ModelConfig, ValidationConfig
from diffpipe.data.cache.buckets import load_image
from diffpipe.data.cache.latents import LatentShard
from diffpipe.data.cache.plan import make_plan, read_spec
from diffpipe.data.cache.reader import CachedDataset
from diffpipe.data.dataset.demo import demo_item
from diffpipe.data.dataset.validate import run_validation
from diffpipe.families import get_family
from diffpipe.paths import RunPaths

MODEL = ModelConfig(family="sd")
RATIOS = [(64, 64), (96, 64), (64, 96), (128, 64), (64, 128), (80, 64), (64, 80), (112, 64)]


def write_image(folder: Path, i: int, tag: str = "img") -> None:
    img, caption = demo_item(i, size=64)
    w, h = random.Random(i).choice(RATIOS)
    img = img.resize((w, h))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    (folder / f"{tag}_{i:05d}.png").write_bytes(buf.getvalue())
    (folder / f"{tag}_{i:05d}.txt").write_text(f"{caption}, number {i}\n")


class Bench:
    def __init__(self, root: Path, n: int, shards: int, workers: int):
        self.data = root / "data"
        self.data.mkdir(parents=True)
        for i in range(n):
            write_image(self.data, i)
        self.paths = RunPaths(root / "run")
        self.family = get_family(MODEL)
        self.cache = CacheConfig(shards=shards, batch_size=8, workers=workers)
        self.datasets = [DatasetConfig(name="bench", path=str(self.data), resolution=64)]
        self.specs: dict[Path, bytes] = {}

    def plan(self) -> None:
        p = self.paths
        run_validation(
            self.datasets,
            ValidationConfig(),
            manifest_path=p.manifest,
            report_json=p.report_json,
            report_html=p.report_html,
        )
        make_plan(
            p.manifest,
            self.datasets,
            self.cache,
            latent_identity=self.family.vae_identity(),
            text_identity=self.family.text_identity(),
            pixel_multiple=self.family.pixel_multiple,
            paths=p,
            global_batch=4,
        )

    def jobs(self) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {"latents": [], "text": []}
        p = self.paths
        for s in p.shard_names():
            for kind, spec, target, fn in (
                ("latents", p.latent_spec(s), p.latent_shard(s), cache_latents),
                ("text", p.text_spec(s), p.text_shard(s), cache_text),
            ):
                data = spec.read_bytes()
                if self.specs.get(spec) != data:
                    if target.is_dir():
                        shutil.rmtree(target)
                    out[kind].append(fn(spec, target, MODEL, self.cache))
                    self.specs[spec] = data
        return out


def total(jobs, field):
    return sum(s[field] for kind in jobs.values() for s in kind)


def encoder_only(bench: Bench) -> float:
    """Seconds of VAE calls alone on pre-decoded tensors, with the jobs' batches."""
    vae = bench.family.load_vae()
    seconds = 0.0
    for s in bench.paths.shard_names():
        items = read_spec(bench.paths.latent_spec(s))["items"]
        groups: dict[tuple, list] = {}
        for it in items:
            groups.setdefault(tuple(it["bucket"]), []).append(it)
        for bucket, group in sorted(groups.items()):
            for i in range(0, len(group), bench.cache.batch_size):
                batch = torch.stack([load_image(it["path"], bucket[1:]) for it in group[i : i + 8]])
                t0 = time.perf_counter()
                with torch.no_grad():
                    bench.family.encode_pixels(vae, batch)
                seconds += time.perf_counter() - t0
    return seconds


def reader_speed(bench: Bench) -> dict[str, float]:
    from diffpipe.training import adapter

    t0 = time.perf_counter()
    ds = CachedDataset.from_run(bench.paths)
    open_s = time.perf_counter() - t0
    batches = ds.epoch_batches(0, 4, seed=0)
    t0 = time.perf_counter()
    for b in batches:
        ds.collate(b)
    per_batch = (time.perf_counter() - t0) / len(batches)

    fam = bench.family
    denoiser = fam.load_denoiser()
    params = adapter.add_lora(
        denoiser, adapter.peft_config(LoraConfig(rank=4), fam.lora_targets(None))
    )
    opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(0)
    square = [b for b in batches if ds.items[b[0]].bucket == "1x64x64"][:6]
    steps = []
    for b in square:
        batch = ds.collate(b)
        t0 = time.perf_counter()
        loss = fam.loss(denoiser, batch["latents"], batch["text"], g).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        steps.append(time.perf_counter() - t0)
    step = sorted(steps[1:])[len(steps[1:]) // 2]

    # Zarr: one read call per row vs the whole bucket array in one call.
    shard = LatentShard(bench.paths.latent_shard("s0000"))
    name = max(shard.names, key=lambda n: shard.shape(n)[0])
    arr = shard.group[name]
    rows = shard.shape(name)[0]
    t0 = time.perf_counter()
    for r in range(rows):
        arr[r]
    per_row = time.perf_counter() - t0
    t0 = time.perf_counter()
    arr[...]
    block = time.perf_counter() - t0
    return {
        "open_and_verify_s": round(open_s, 3),
        "collate_ms_per_batch": round(per_batch * 1e3, 4),
        "train_step_ms": round(step * 1e3, 1),
        "reader_speedup_vs_training": round(step / per_batch, 1),
        "zarr_rows": rows,
        "zarr_per_row_reads_ms": round(per_row * 1e3, 1),
        "zarr_one_block_read_ms": round(block * 1e3, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/diffpipe-cache-bench"))
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    bench = Bench(args.dir, args.n, args.shards, args.workers)
    res: dict[str, object] = {"n": args.n, "shards": args.shards, "decode_workers": args.workers}

    bench.plan()
    full = bench.jobs()
    full_wall = total(full, "wall_s")
    lat_wall = sum(s["wall_s"] for s in full["latents"])
    res["full"] = {
        "wall_s": round(full_wall, 2),
        "latents_wall_s": round(lat_wall, 2),
        "encoded": total(full, "encoded"),
    }

    for i in range(10):
        write_image(bench.data, 100_000 + i, tag="added")
    bench.plan()
    add = bench.jobs()
    res["add_10"] = {
        "jobs": sum(map(len, add.values())),
        "wall_s": round(total(add, "wall_s"), 2),
        "fraction_of_full": round(total(add, "wall_s") / full_wall, 4),
        "latents_encoded": sum(s["encoded"] for s in add["latents"]),
        "text_encoded": sum(s["encoded"] for s in add["text"]),
        "reused": total(add, "reused"),
    }

    caption = sorted(bench.data.glob("img_*.txt"))[7]
    caption.write_text(caption.read_text().strip() + ", edited\n")
    bench.plan()
    edit = bench.jobs()
    res["caption_edit"] = {
        "text_encoded": sum(s["encoded"] for s in edit["text"]),
        "latents_encoded": sum(s["encoded"] for s in edit["latents"]),
        "latent_jobs": len(edit["latents"]),
    }

    bench.plan()
    res["no_change_jobs"] = sum(map(len, bench.jobs().values()))

    enc = encoder_only(bench)
    res["latent_stage_over_encoder"] = {
        "latents_wall_s": round(lat_wall, 2),
        "encoder_only_s": round(enc, 2),
        "ratio": round(lat_wall / enc, 3),
        "decode_wait_s": round(sum(s["decode_wait_s"] for s in full["latents"]), 2),
    }
    res["reader"] = reader_speed(bench)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
