"""The cache stages through Snakemake: first run, no-change rerun, +10 images, one caption edit.

Usage (figures in docs/benchmarks.md, "Benchmarks"):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cache_workflow.py --n 1000 [--shards 8] [--dir /tmp/cw]

Runs ``diffpipe run`` (a fresh process each time, imports and DAG building
included) up to the train rule (``train.max_steps: 1``) on N generated images
of mixed aspect ratios with the tiny SD family, and reports per run: wall
time, the jobs Snakemake ran, and the ``encoded`` / ``reused`` counts of the
cache jobs' summaries. Targets: the no-change rerun runs zero jobs in < 3 s;
+10 images encodes exactly 10 latents; a caption edit encodes 1 caption and
no latents.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cache_incremental import write_image  # noqa: E402

from diffpipe.paths import RunPaths  # noqa: E402


def counts(paths: RunPaths, since: float) -> dict[str, int]:
    out = {"latents_encoded": 0, "latents_reused": 0, "text_encoded": 0, "text_reused": 0}
    for f in (paths.root / "cache").rglob("*.summary.json"):
        if f.stat().st_mtime >= since:
            s = json.loads(f.read_text())
            kind = "latents" if s["kind"] == "latents" else "text"
            out[f"{kind}_encoded"] += s["encoded"]
            out[f"{kind}_reused"] += s["reused"]
    return out


def run(cfg: Path, root: Path, target: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "diffpipe",
        "run",
        "-c",
        str(cfg),
        "--cores",
        "2",
        "--workdir",
        str(root),
        "--target",
        target,
        "--",
        "--resources=gpu=2",  # one token: the option takes several values
    ]
    start = time.time()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"diffpipe run failed ({proc.returncode})")
    paths = RunPaths(root / "run")
    jobs = [
        str(f.relative_to(paths.benchmarks)).removesuffix(".tsv")
        for f in paths.benchmarks.rglob("*.tsv")
        if f.stat().st_mtime >= start
    ]
    return {
        "wall_s": round(wall, 2),
        "jobs": len(jobs),
        "cache_jobs": sorted(j for j in jobs if j.startswith("cache")),
        **counts(paths, start),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/diffpipe-cache-workflow"))
    args = ap.parse_args()
    root = args.dir
    shutil.rmtree(root, ignore_errors=True)
    data = root / "data"
    data.mkdir(parents=True)
    for i in range(args.n):
        write_image(data, i)
    cfg = {
        "output_dir": "run",
        "datasets": [{"name": "bench", "path": str(data), "resolution": 64}],
        "cache": {"shards": args.shards, "batch_size": 8, "workers": 1},
        "train": {"max_steps": 1, "batch_size": 4},
    }
    (root / "config.yaml").write_text(yaml.safe_dump(cfg))
    target = "run/train/adapter/adapter_model.safetensors"  # as the rule names it (workdir-relative)
    res = {"n": args.n, "shards": args.shards}
    res["first"] = run(root / "config.yaml", root, target)
    res["no_change"] = run(root / "config.yaml", root, target)
    for i in range(10):
        write_image(data, 100_000 + i, tag="added")
    res["add_10"] = run(root / "config.yaml", root, target)
    caption = sorted(data.glob("img_*.txt"))[7]
    time.sleep(1.1)
    caption.write_text(caption.read_text().strip() + ", edited\n")
    res["caption_edit"] = run(root / "config.yaml", root, target)
    res["no_change_again"] = run(root / "config.yaml", root, target)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
