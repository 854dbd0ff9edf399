"""Single-job vs sharded validation: where sharding starts to pay.

    python benchmarks/validate_shards.py --n 2000 --n 6000 --shards 4 --work /tmp/vshards
    python benchmarks/validate_shards.py --parquet --table-files 8 --n 50000 --shards 4 --work /tmp/tshards

For each N it generates N small images with captions (or reuses them): files, or with
``--parquet`` a table dataset of N rows of PNG bytes in ``--table-files`` Parquet files (a table's
validation shards are its files). Then on a fresh output folder it runs `diffpipe validate` as one
job, and on another runs the `validation.shards` jobs one after another (`diffpipe validate-shard`)
and the merging `diffpipe validate`. Prints wall time and peak RSS (the largest process: a job's
probe workers are processes of their own) of each; "cluster" is the slowest shard plus the merge
(the shards side by side on separate nodes), "one machine" their sum. Writes results.json.
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
from dag_scale import measured, write_table  # noqa: E402  (the same wall time and peak RSS measure)


def _run(cmd: list[str], root: Path) -> tuple[float, int]:
    """Wall seconds and the largest process's peak RSS (MiB) of one command, which must succeed."""
    res = measured(cmd, root, min_available_mib=1024, max_process_mib=16384)
    if res["rc"] != 0 or res["killed"]:
        raise SystemExit(f"{' '.join(cmd)} failed ({res['killed'] or res['rc']}):\n{res['out'][-2000:]}")
    return res["s"], max(res["process_peak_mib"].values(), default=0)


def _config(root: Path, data: Path, name: str, shards: int) -> Path:
    cfg = {"output_dir": name, "datasets": [{"name": "bench", "path": str(data), "resolution": 32}],
           "validation": {"shards": shards}}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    if (root / "generated").exists():  # only in a folder this benchmark generated: its own output folders
        shutil.rmtree(root / name, ignore_errors=True)  # a fresh output folder: every file is probed
    return path


def bench(n: int, work: Path, shards: int, workers: int, table_files: int = 0) -> dict:
    from diffpipe.data.dataset.demo import write_demo_dataset
    from diffpipe.data.dataset.discover import vshard_names

    root = work / (f"rows{n}-{table_files}" if table_files else f"n{n}")
    data = root / "data"
    if not (root / "generated").exists():
        t = time.perf_counter()
        if table_files:
            per_file = -(-n // table_files)
            write_table(data, 0, n, rows_per_file=per_file, group=min(per_file, 50_000))
        else:
            write_demo_dataset(data, n=n, size=32, seed=0)
        (root / "generated").write_text(str(n))
        print(f"n={n}: generated in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    dp = [sys.executable, "-m", "diffpipe"]
    w = ["--workers", str(workers)]
    res: dict = {"n": n, "table_files": table_files, "shards": shards}
    one = _config(root, data, "one", 1)
    res["single_s"], res["single_rss_mib"] = _run([*dp, "validate", "-c", str(one), *w], root)
    many = _config(root, data, "sharded", shards)
    runs = [_run([*dp, "validate-shard", "-c", str(many), "--shard", s, *w], root) for s in vshard_names(shards)]
    res["shard_max_s"] = max(s for s, _ in runs)
    res["shard_rss_mib"] = max(r for _, r in runs)
    res["merge_s"], res["merge_rss_mib"] = _run([*dp, "validate", "-c", str(many), *w], root)
    res["cluster_s"] = res["shard_max_s"] + res["merge_s"]
    res["one_machine_s"] = sum(s for s, _ in runs) + res["merge_s"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, action="append", help="dataset sizes (repeatable)")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2, help="probe processes per job")
    ap.add_argument("--work", type=Path, default=Path("/tmp/diffpipe-vshards"))
    ap.add_argument("--parquet", action="store_true", help="a Parquet table dataset instead of files")
    ap.add_argument("--table-files", type=int, default=8, help="with --parquet: the table's files")
    args = ap.parse_args()
    files = args.table_files if args.parquet else 0
    results = [bench(n, args.work, args.shards, args.workers, files) for n in args.n or [2000]]
    keys = list(results[0])
    print(" | ".join(keys))
    for r in results:
        print(" | ".join(f"{r[k]:.2f}" if isinstance(r[k], float) else str(r[k]) for k in keys))
    (args.work / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
