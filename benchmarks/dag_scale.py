"""How the workflow scales with the dataset: dry-run time and peak memory.

    python benchmarks/dag_scale.py --n 10000 --n 100000 --work /tmp/dagscale

For each N it generates N small images with captions, runs `diffpipe
validate` and `diffpipe plan` (peak RSS of each, measured on the process
tree), one `diffpipe cache latents` shard job (its peak RSS does not depend
on N: a shard holds `--items-per-shard` items), then times
`diffpipe run --dry-run` over the planned DAG. Prints a table and writes
results.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

_MEASURE = (
    "import resource, subprocess, sys, time;"
    "t = time.perf_counter(); rc = subprocess.run(sys.argv[1:]).returncode;"
    "dt = time.perf_counter() - t;"
    "print(rc, dt, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)"
)


def measured(cmd: list[str], cwd: Path) -> tuple[float, float]:
    """(seconds, peak RSS in MiB of the largest process) of one command."""
    out = subprocess.run([sys.executable, "-c", _MEASURE, *cmd], cwd=cwd, capture_output=True, text=True)
    rc, seconds, rss_kb = out.stderr.strip().splitlines()[-1].split()
    if rc != "0":
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return float(seconds), int(rss_kb) / 1024


def bench(n: int, work: Path, items_per_shard: int) -> dict:
    from diffpipe.data.dataset.demo import write_demo_dataset

    root = work / f"n{n}"
    data = root / "data"
    done = root / "generated"  # marker outside the dataset, so reruns reuse it
    if not done.exists():
        t = time.perf_counter()
        write_demo_dataset(data, n=n, size=32, seed=0)
        done.write_text(str(n))
        print(f"n={n}: generated in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    cfg = {
        "output_dir": "run",
        "datasets": [{"name": "bench", "path": str(data), "resolution": 32}],
        "cache": {"shards": max(1, n // items_per_shard)},
    }
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    dp = [sys.executable, "-m", "diffpipe"]
    res = {"n": n, "shards": cfg["cache"]["shards"]}
    res["validate_s"], res["validate_rss_mib"] = measured([*dp, "validate", "-c", str(config)], root)
    res["plan_s"], res["plan_rss_mib"] = measured([*dp, "plan", "-c", str(config)], root)
    res["cache_shard_s"], res["cache_shard_rss_mib"] = measured(
        [*dp, "cache", "latents", "-c", str(config), "--shard", "s0000"], root
    )
    # Bring Snakemake to "validated and planned" (fast now: nothing is re-read),
    # so the dry-run below sees every shard job of the planned DAG.
    measured([*dp, "run", "-c", str(config), "--cores", "2", "--target", "run/plan"], root)
    res["dry_run_s"], _ = measured([*dp, "run", "-c", str(config), "--dry-run", "--cores", "2"], root)
    dry = subprocess.run([*dp, "run", "-c", str(config), "--dry-run", "--cores", "2"], cwd=root,
                         capture_output=True, text=True)
    res["dry_run_jobs"] = next((int(line.split()[1]) for line in (dry.stdout + dry.stderr).splitlines()
                                if line.startswith("total")), -1)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, action="append", help="dataset sizes (repeatable)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/diffpipe-dagscale"))
    ap.add_argument("--items-per-shard", type=int, default=1000)
    args = ap.parse_args()
    results = [bench(n, args.work, args.items_per_shard) for n in args.n or [10_000]]
    keys = list(results[0])
    print(" | ".join(keys))
    for r in results:
        print(" | ".join(f"{r[k]:.2f}" if isinstance(r[k], float) else str(r[k]) for k in keys))
    (args.work / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
