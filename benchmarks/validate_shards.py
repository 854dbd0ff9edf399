"""Single-job vs sharded validation: where sharding starts to pay.

    python benchmarks/validate_shards.py --n 2000 --n 6000 --shards 4 --work /tmp/vshards

For each N it generates N small images with captions (or reuses them), then on a fresh
output folder runs `diffpipe validate` as one job, and on another runs the
`validation.shards` jobs one after another (`diffpipe validate-shard`) and the merging
`diffpipe validate`. Prints wall time and peak RSS of each; "cluster" is the slowest
shard plus the merge (the shards side by side on separate nodes), "one machine" their sum.
Writes results.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dag_scale import measured  # noqa: E402  (the same wall time and peak RSS measure)


def _config(root: Path, data: Path, name: str, shards: int) -> Path:
    cfg = {"output_dir": name, "datasets": [{"name": "bench", "path": str(data), "resolution": 32}],
           "validation": {"shards": shards}}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    if (root / "generated").exists():  # only in a folder this benchmark generated: its own output folders
        shutil.rmtree(root / name, ignore_errors=True)  # a fresh output folder: every file is probed
    return path


def bench(n: int, work: Path, shards: int, workers: int) -> dict:
    from diffpipe.data.dataset.demo import write_demo_dataset
    from diffpipe.data.dataset.discover import vshard_names

    root = work / f"n{n}"
    data = root / "data"
    if not (root / "generated").exists():
        t = time.perf_counter()
        write_demo_dataset(data, n=n, size=32, seed=0)
        (root / "generated").write_text(str(n))
        print(f"n={n}: generated in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    dp = [sys.executable, "-m", "diffpipe"]
    w = ["--workers", str(workers)]
    res: dict = {"n": n, "shards": shards}
    one = _config(root, data, "one", 1)
    res["single_s"], res["single_rss_mib"] = measured([*dp, "validate", "-c", str(one), *w], root)
    many = _config(root, data, "sharded", shards)
    runs = [measured([*dp, "validate-shard", "-c", str(many), "--shard", s, *w], root) for s in vshard_names(shards)]
    res["shard_max_s"] = max(s for s, _ in runs)
    res["shard_rss_mib"] = max(r for _, r in runs)
    res["merge_s"], res["merge_rss_mib"] = measured([*dp, "validate", "-c", str(many), *w], root)
    res["cluster_s"] = res["shard_max_s"] + res["merge_s"]
    res["one_machine_s"] = sum(s for s, _ in runs) + res["merge_s"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, action="append", help="dataset sizes (repeatable)")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2, help="probe processes per job")
    ap.add_argument("--work", type=Path, default=Path("/tmp/diffpipe-vshards"))
    args = ap.parse_args()
    results = [bench(n, args.work, args.shards, args.workers) for n in args.n or [2000]]
    keys = list(results[0])
    print(" | ".join(keys))
    for r in results:
        print(" | ".join(f"{r[k]:.2f}" if isinstance(r[k], float) else str(r[k]) for k in keys))
    (args.work / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
