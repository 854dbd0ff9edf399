"""How the workflow scales with the dataset: wall time and peak memory of each job.

    python benchmarks/dag_scale.py --n 100000 --work /tmp/dagscale
    python benchmarks/dag_scale.py --n 1000000 --parquet-n 10000000 --validation-shards 100

For each point it generates a dataset (``--n``: N tiny PNG files with ``.txt``
captions, 1,000 per folder; ``--parquet-n``: one Parquet table folder of N rows
of PNG bytes and captions, written row group by row group), then drives the
workflow through ``diffpipe run`` up to the plan:

1. first run (validate, plan);
2. no-change rerun (Snakemake should run no job);
3. ``diffpipe run --dry-run`` over the whole workflow (its job counts, read
   from Snakemake's "Job stats" table);
4. a +1% change (1% new items: new files, or one new Parquet file), then the
   same run again: which jobs ran and which cache shard specs the plan
   rewrote (files with a new mtime: one latent and one text spec when the
   new items all go to one shard). The cache jobs do not run here, so a dry
   run cannot show which shards are stale; a spec with a new mtime is newer
   than its shard, and Snakemake reruns that shard unless the spec is under
   its ``--max-checksum-file-size`` and its checksum is the recorded one.

Each job's wall time and peak RSS come from Snakemake's own benchmark files
(``run/benchmarks/**.tsv``, column ``s`` and ``max_rss``); a job ran in a step
when its benchmark file was rewritten. The RSS of every process of the tree
(Snakemake, its jobs) is polled every 0.2 s: each command's peak (the largest
process) and the summed tree's. A step is stopped when the machine's available
memory falls below ``--min-available-mib`` (shared machine) or one process
passes ``--max-process-mib``: the result then says so. Writes results.json
and results.md (a table per step) in ``--work`` after each point.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import psutil
import yaml

# The PNG templates: smooth 32 px images (a few hundred bytes each); every item
# gets its own tEXt chunk, so each file's SHA-256 differs and every item is new
# content to validation, while writing a million of them costs no encoding.
_TEMPLATES: list[bytes] = []
_COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "white", "grey"]


def _templates() -> list[bytes]:
    if not _TEMPLATES:
        import io

        from PIL import Image

        for k in range(len(_COLOURS)):
            img = Image.linear_gradient("L").resize((32, 32)).convert("RGB")
            img = Image.merge("RGB", [c.point(lambda v, k=k, j=j: (v * (k + j + 1)) % 256)
                                      for j, c in enumerate(img.split())])
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            _TEMPLATES.append(buf.getvalue())
    return _TEMPLATES


def png_bytes(i: int) -> bytes:
    """A valid PNG whose bytes are unique to item ``i`` (a tEXt chunk after IHDR)."""
    tpl = _templates()[i % len(_COLOURS)]
    body = b"tEXt" + b"item\0" + str(i).encode()
    chunk = struct.pack(">I", len(body) - 4) + body + struct.pack(">I", zlib.crc32(body))
    return tpl[:33] + chunk + tpl[33:]  # 8-byte signature + 25-byte IHDR chunk


def caption(i: int) -> str:
    return f"a {_COLOURS[i % len(_COLOURS)]} gradient, item {i}"


def write_files(data: Path, start: int, stop: int) -> None:
    """Items ``start..stop-1`` as ``data/<i // 1000>/<i>.png`` and ``.txt``."""
    for i in range(start, stop):
        folder = data / f"{i // 1000:05d}"
        if i % 1000 == 0 or i == start:
            folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:08d}.png").write_bytes(png_bytes(i))
        (folder / f"{i:08d}.txt").write_text(caption(i))


def write_table(data: Path, start: int, stop: int, rows_per_file: int = 500_000, group: int = 50_000) -> None:
    """Rows ``start..stop-1`` as Parquet files ``data/default/train/<first row>.parquet``, one row group of
    ``group`` rows at a time (never the whole table in memory)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = data / "default" / "train"
    folder.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([("image", pa.binary()), ("text", pa.string())])
    for first in range(start, stop, rows_per_file):
        last = min(stop, first + rows_per_file)
        tmp = folder / f".{first:09d}.parquet.tmp"
        with pq.ParquetWriter(tmp, schema) as writer:
            for g in range(first, last, group):
                rows = range(g, min(last, g + group))
                writer.write_table(pa.table({"image": [png_bytes(i) for i in rows],
                                             "text": [caption(i) for i in rows]}, schema=schema))
        tmp.rename(folder / f"{first:09d}.parquet")


def _tree_rss(proc: psutil.Process, peaks: dict[int, tuple[int, str]]) -> int:
    """The summed RSS of ``proc`` and its children; each process's own peak kept in ``peaks``."""
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            rss = p.memory_info().rss
            if rss > peaks.get(p.pid, (0, ""))[0]:
                peaks[p.pid] = (rss, peaks.get(p.pid, (0, ""))[1] or _label(p))
        except psutil.Error:
            continue
        total += rss
    return total


def _label(p: psutil.Process) -> str:
    """A process's command, short: ``snakemake``, ``diffpipe validate``, ``bash``..."""
    try:
        argv = p.cmdline()
    except psutil.Error:
        return "?"
    words = [Path(a).name for a in argv[:6] if not a.startswith("-")]
    for tool in ("snakemake", "diffpipe"):
        if tool in words:
            i = words.index(tool)
            return " ".join(words[i:i + 2]) if tool == "diffpipe" else tool
    return " ".join(words[:2])


def _kill_tree(proc: psutil.Process) -> None:
    """Kill ``proc`` and every process under it: Snakemake runs in a session of its own, which
    killing ``diffpipe run``'s process group would leave running (and holding the output pipe)."""
    for p in [proc, *proc.children(recursive=True)]:
        try:
            p.kill()
        except psutil.Error:
            pass


def measured(cmd: list[str], cwd: Path, min_available_mib: int, max_process_mib: int) -> dict:
    """Wall time, peak summed RSS of the process tree, the largest process's peak, output; stopped
    (``killed``) on low machine memory or when one process passes ``max_process_mib``."""
    t = time.perf_counter()
    proc = psutil.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        start_new_session=True)
    peak, killed, chunks, peaks = 0, None, [], {}
    import threading

    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    while proc.poll() is None:
        peak = max(peak, _tree_rss(proc, peaks))
        avail = psutil.virtual_memory().available >> 20
        big = max(peaks.values(), default=(0, ""))
        if killed is None and (avail < min_available_mib or big[0] >> 20 > max_process_mib):
            killed = (f"stopped after {time.perf_counter() - t:.0f} s: machine had {avail} MiB available, "
                      f"tree at {peak >> 20} MiB, {big[1]} at {big[0] >> 20} MiB")
            _kill_tree(proc)
        time.sleep(0.2)
    reader.join()
    per_command: dict[str, int] = {}
    for rss, label in peaks.values():
        per_command[label] = max(per_command.get(label, 0), rss >> 20)
    return {"s": round(time.perf_counter() - t, 2), "tree_peak_rss_mib": peak >> 20, "rc": proc.returncode,
            "killed": killed, "process_peak_mib": per_command, "out": "".join(chunks)}


def job_stats(text: str) -> dict[str, int]:
    """Snakemake's "Job stats" table (``rule count`` rows up to ``total``) as a dict."""
    stats, inside = {}, False
    for line in text.splitlines():
        if line.startswith("Job stats:"):
            inside = True
        elif inside and (m := re.fullmatch(r"(\w+)\s+(\d+)", line.strip())):
            stats[m[1]] = int(m[2])
            if m[1] == "total":
                break
    return stats


def benchmarks_since(run: Path, since: float) -> dict[str, dict]:
    """Snakemake benchmark files rewritten after ``since``: job -> wall seconds and max RSS (MiB)."""
    jobs = {}
    for tsv in sorted((run / "benchmarks").rglob("*.tsv")):
        if tsv.stat().st_mtime >= since:
            row = next(csv.DictReader(tsv.open(), delimiter="\t"))
            jobs[str(tsv.relative_to(run / "benchmarks").with_suffix(""))] = {
                "s": float(row["s"]), "max_rss_mib": float(row["max_rss"]) if row["max_rss"] != "NA" else None}
    return jobs


def specs_since(run: Path, since: float) -> list[str]:
    """Cache shard spec files the plan (re)wrote after ``since``."""
    specs = [*(run / "plan").glob("latents/*.json"), *(run / "plan").glob("text/*.json"), run / "plan" / "empty.json"]
    return sorted(str(p.relative_to(run)) for p in specs if p.exists() and p.stat().st_mtime >= since)


def _step(name: str, cmd: list[str], root: Path, run: Path, args: argparse.Namespace) -> dict:
    since = time.time()
    res = measured(cmd, root, args.min_available_mib, args.max_process_mib)
    out = res.pop("out")
    if "--dry-run" in cmd:
        res["stats"] = job_stats(out)
    res["jobs"] = benchmarks_since(run, since)
    res["specs_rewritten"] = len(specs_since(run, since)) if (run / "plan").exists() else 0
    if res["rc"] != 0:
        res["error_tail"] = out[-3000:]
    print(f"{name}: {res['s']} s, tree {res['tree_peak_rss_mib']} MiB, rc {res['rc']}, "
          f"{len(res['jobs'])} jobs, processes {res['process_peak_mib']}" + (f", {res['killed']}" if res["killed"]
                                                                          else ""), file=sys.stderr)
    if "stats" in res:
        print(f"{name}: job stats {res['stats']}", file=sys.stderr)
    return res


def bench(kind: str, n: int, args: argparse.Namespace) -> dict:
    root = args.work / f"{kind}{n}"
    data, run = root / "data", root / "run"
    write = write_files if kind == "files" else write_table
    if not (root / "generated").exists():  # marker outside the dataset, so reruns reuse it
        t = time.perf_counter()
        write(data, 0, n)
        (root / "generated").write_text(str(n))
        print(f"{kind} n={n}: generated in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    cfg: dict = {"output_dir": "run", "datasets": [{"name": "bench", "path": str(data), "resolution": 32}],
                 "cache": {"shards": max(1, n // args.items_per_shard)}}
    if args.validation_shards:
        cfg["validation"] = {"shards": args.validation_shards}
    (root / "config.yaml").write_text(yaml.safe_dump(cfg))
    dp = [sys.executable, "-m", "diffpipe", "run", "-c", str(root / "config.yaml"), "--cores", "2"]
    to_plan = [*dp, "--target", "run/plan"]
    res: dict = {"kind": kind, "n": n, "shards": cfg["cache"]["shards"]}
    res["first_run"] = _step("first run", to_plan, root, run, args)
    if res["first_run"]["rc"] != 0:  # stopped or failed: nothing after it means anything
        return res
    res["no_change_rerun"] = _step("no-change rerun", to_plan, root, run, args)
    res["dry_run"] = _step("dry-run", [*dp, "--dry-run"], root, run, args)
    if not (root / "changed").exists():
        write(data, n, n + n // 100)
        (root / "changed").write_text(str(n // 100))
    res["plus_1pct"] = _step("+1% change", to_plan, root, run, args)
    return res


def markdown(results: list[dict]) -> str:
    """One table row per step: wall time, the largest process's and the tree's peak RSS, jobs run."""
    steps = {"first_run": "first run (to plan)", "no_change_rerun": "no-change rerun",
             "dry_run": "`--dry-run` (whole workflow)", "plus_1pct": "+1% items (to plan)"}
    rows = ["| items | step | wall | largest process (peak RSS) | tree peak | jobs run (or planned) | specs rewritten |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        for key, title in steps.items():
            if key not in r:
                continue
            st = r[key]
            big = max(st["process_peak_mib"].items(), key=lambda kv: kv[1], default=("-", 0))
            if "stats" in st:
                jobs = ", ".join(f"{k} {v}" for k, v in st["stats"].items())
            else:
                jobs = ", ".join(f"{j} {v['s']:.1f} s / {v['max_rss_mib'] or 0:.0f} MiB" for j, v in st["jobs"].items())
            note = f" ({st['killed']})" if st["killed"] else "" if st["rc"] == 0 else f" (exit {st['rc']})"
            rows.append(f"| {r['kind']} {r['n']:,} | {title} | {st['s']:.1f} s{note} | {big[0]} {big[1]:,} MiB "
                        f"| {st['tree_peak_rss_mib']:,} MiB | {jobs or 'none'} | {st['specs_rewritten']} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, action="append", default=[], help="file dataset sizes (repeatable)")
    ap.add_argument("--parquet-n", type=int, action="append", default=[], help="Parquet table sizes (repeatable)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/diffpipe-dagscale"))
    ap.add_argument("--items-per-shard", type=int, default=1000)
    ap.add_argument("--validation-shards", type=int, default=0, help="validation.shards (0: leave unset)")
    ap.add_argument("--min-available-mib", type=int, default=1500)
    ap.add_argument("--max-process-mib", type=int, default=8192, help="stop a step when one process passes it")
    args = ap.parse_args()
    points = [("files", n) for n in args.n] + [("parquet", n) for n in args.parquet_n] or [("files", 10_000)]
    args.work.mkdir(parents=True, exist_ok=True)
    results = []
    for kind, n in points:  # written after each point: a later one may be stopped
        results.append(bench(kind, n, args))
        (args.work / "results.json").write_text(json.dumps(results, indent=2))
        (args.work / "results.md").write_text(markdown(results))


if __name__ == "__main__":
    main()
