"""What a run produced, read back from its files: validation, caches, training, samples, stage times.

Each reader takes the run's paths and returns plain data (empty when the file is not there: a run
stopped early still gets a page saying what it has). Nothing here writes.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path
from typing import Any

from diffpipe.config import load_yaml
from diffpipe.paths import RunPaths
from diffpipe.training.metrics import read_metrics


def read_json(path: Path) -> dict[str, Any]:
    """``path``'s JSON object, or ``{}`` when it is missing or not a JSON object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def validation(paths: RunPaths) -> dict[str, Any]:
    """The validation report's summary, per-dataset counts and counts per reason."""
    data = read_json(paths.report_json)
    return {k: data.get(k) or {} for k in ("summary", "datasets", "counts")} if data else {}


def cache_stats(paths: RunPaths) -> dict[str, dict[str, float]]:
    """Per kind (latents, text): shards, items, entries encoded and reused, and seconds, summed over shards."""
    out: dict[str, dict[str, float]] = {}
    for f in sorted((paths.root / "cache").glob("*/*.summary.json")):
        s = read_json(f)
        kind = str(s.get("kind") or f.parent.name)
        t = out.setdefault(kind, {"shards": 0, "items": 0, "encoded": 0, "reused": 0, "wall_s": 0.0})
        t["shards"] += 1
        for key in ("items", "encoded", "reused", "wall_s"):
            value = s.get(key)
            t[key] += value if isinstance(value, (int, float)) else 0
    return out


def metrics(paths: RunPaths) -> list[dict[str, Any]]:
    """The rows of ``train/metrics.jsonl`` (none when training has not run)."""
    try:
        return read_metrics(paths.metrics)
    except (OSError, ValueError):
        return []


def _values(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]


def throughput(rows: list[dict[str, Any]], summary: dict[str, Any]) -> dict[str, Any]:
    """Speed and memory of training: medians over steps (the first step, which warms up, left out)."""
    steady = rows[1:] if len(rows) > 2 else rows
    out: dict[str, Any] = {}
    for key, label in (("samples_per_s", "samples/s (median)"), ("step_time", "seconds per step (median)"),
                       ("tflops_per_device", "TFLOP/s per device (median)")):
        if values := _values(steady, key):
            out[label] = statistics.median(values)
    if memory := _values(rows, "peak_memory_mb"):
        out["peak memory, MiB (GPU allocator peak; CPU: max RSS)"] = max(memory)
    for key in ("steps", "seconds", "world_size", "skipped_steps", "resumed_from"):
        if key in summary:
            out[f"{key} (train/summary.json)"] = summary[key]
    for key in ("offload", "memory", "memory_plan"):
        if summary.get(key):
            out[f"{key} (train/summary.json)"] = json.dumps(summary[key], sort_keys=True)
    return out


def stage_times(paths: RunPaths) -> list[dict[str, Any]]:
    """Each job's last Snakemake benchmark: seconds and peak resident memory (MB)."""
    rows = []
    folder = paths.benchmarks
    for f in sorted(folder.rglob("*.tsv")) if folder.is_dir() else []:
        try:
            with open(f, newline="") as fh:
                last = list(csv.DictReader(fh, delimiter="\t"))[-1]
        except (OSError, IndexError, csv.Error):
            continue
        rows.append({"job": str(f.relative_to(folder).with_suffix("")), "seconds": last.get("s", ""),
                     "max_rss_mb": last.get("max_rss", "")})
    return rows


def run_config(paths: RunPaths) -> tuple[Path | None, dict[str, Any]]:
    """The config training ran with (``train/config.yaml``), else the run's resolved config; and its path."""
    for f in (paths.train_dir / "config.yaml", paths.root / "resolved-config.yaml"):
        if f.is_file():
            try:
                data = load_yaml(f)
            except Exception:  # noqa: BLE001 - a damaged file is shown as text, not parsed
                data = {}
            return f, data if isinstance(data, dict) else {}
    return None, {}


def step_samples(paths: RunPaths) -> list[tuple[int, Path]]:
    """(step, file) of the rows the sampler rendered during training, in step order."""
    out = []
    for f in (paths.train_dir / "samples").glob("step-*.png"):
        digits = f.stem.removeprefix("step-")
        if digits.isdigit():
            out.append((int(digits), f))
    return sorted(out)
