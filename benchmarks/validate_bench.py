"""Validation throughput: a first run over N small captioned images, then a no-change rerun.

Usage (figures in docs/benchmarks.md, "Benchmarks"):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/validate_bench.py --n 10000 [--workers 2] [--dir /tmp/vb]

The first run hashes and fully decodes every image in a worker pool and
counts caption tokens with the tiny SD family's real CLIP tokenizer
(tokenizer loading included). The rerun changes nothing, so it must read no
file content: it is timed in process and through the CLI (a fresh Python,
imports included). Targets: first run >= 500 files/s on 2 cores, rerun of
10,000 files < 2 s.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from diffpipe.config import DatasetConfig, ModelConfig, ValidationConfig
from diffpipe.data.dataset.demo import demo_item
from diffpipe.data.dataset.validate import run_validation
from diffpipe.families.token_counter import FamilyTokenCounter


def make_dataset(root: Path, n: int, size: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        img, caption = demo_item(i, size=size)
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        sub = root / f"part{i // 1000:03d}"
        sub.mkdir(exist_ok=True)
        (sub / f"img_{i:06d}.png").write_bytes(buf.getvalue())
        (sub / f"img_{i:06d}.txt").write_text(f"{caption}, number {i}\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument(
        "--workers", type=int, default=None, help="probe processes (default: every core)"
    )
    ap.add_argument("--dir", type=Path, default=Path("/tmp/diffpipe-validate-bench"))
    args = ap.parse_args()

    data, out = args.dir / "data", args.dir / "out"
    shutil.rmtree(args.dir, ignore_errors=True)
    t = time.perf_counter()
    make_dataset(data, args.n, args.size)
    print(f"wrote {args.n} images + captions in {time.perf_counter() - t:.1f} s")

    ds = [DatasetConfig(name="bench", path=str(data), resolution=args.size)]
    kw = dict(
        manifest_path=out / "validate/manifest.parquet",
        report_json=out / "validate/report.json",
        report_html=out / "validate/report.html",
        workers=args.workers,
    )
    vcfg = ValidationConfig()
    t = time.perf_counter()
    first = run_validation(ds, vcfg, tokens=FamilyTokenCounter(ModelConfig()), **kw)
    t_first = time.perf_counter() - t
    t, cpu = time.perf_counter(), time.process_time()
    second = run_validation(ds, vcfg, tokens=FamilyTokenCounter(ModelConfig()), **kw)
    t_rerun, cpu_rerun = time.perf_counter() - t, time.process_time() - cpu
    assert first.kept == args.n and second.hashed == 0 and not second.manifest_changed

    cfg = args.dir / "bench.yaml"
    cfg.write_text(json.dumps({"output_dir": str(out), "datasets": [d.model_dump() for d in ds]}))
    t = time.perf_counter()
    subprocess.run(
        [str(Path(sys.executable).parent / "diffpipe"), "validate", "-c", str(cfg)],
        check=True,
        capture_output=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    t_cli = time.perf_counter() - t

    result = {
        "n": args.n,
        "cores": os.cpu_count(),
        "first_run_s": round(t_first, 2),
        "first_run_files_per_s": round(args.n / t_first),
        "rerun_s": round(t_rerun, 2),
        "rerun_files_per_s": round(args.n / t_rerun),
        "rerun_cpu_s": round(cpu_rerun, 2),  # CPU time: what a shared machine's load does not inflate
        "load_average": round(os.getloadavg()[0], 1),
        "rerun_cli_s": round(t_cli, 2),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
