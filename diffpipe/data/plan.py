"""The shard plan: which item goes to which cache shard, under which key.

Each kept manifest row gets a bucket, a final caption, a latent key and a
text key. Keys hash exactly what determines the cached value:

- latent key = digest(file sha256, bucket, VAE identity, cache dtype);
- text key = digest(final caption, text-encoder identity, cache dtype).

Items go to shard ``int(id) mod shards``, so adding, removing or editing one
item touches only its own shard. Latent and text specs are separate files
(one per shard each), written only when their content changes: a caption
edit rewrites one text spec and no latent spec, so Snakemake re-encodes one
text shard and no latents.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from diffpipe.config import CacheConfig, DatasetConfig
from diffpipe.data.buckets import choose_bucket
from diffpipe.data.latents import bucket_name
from diffpipe.paths import RunPaths, shard_name
from diffpipe.utils import digest, stable_json, write_if_changed

SPEC_VERSION = 1


@dataclass
class PlanResult:
    """What the plan holds and which spec files it wrote or removed."""

    items: int
    shards: list[str]
    buckets: dict[str, int]
    written: list[Path] = field(default_factory=list)
    removed: list[Path] = field(default_factory=list)


def shard_index(item_id: str, shards: int) -> int:
    """Stable shard of an item: its hex id read as an integer, mod ``shards``."""
    return int(item_id, 16) % shards


def final_caption(prefix: str, caption: str) -> str:
    """The caption the model sees: ``prefix`` (e.g. a trigger word), a space, the caption."""
    prefix = prefix.strip()
    return f"{prefix} {caption}" if prefix else caption


def latent_key(sha256: str, bucket: list[int], identity: str, dtype: str) -> str:
    return digest(["latent", sha256, list(bucket), identity, dtype])


def text_key(caption: str, identity: str, dtype: str) -> str:
    return digest(["text", caption, identity, dtype])


def _spec_json(obj: dict[str, Any]) -> str:
    return stable_json(obj) + "\n"


def make_plan(
    manifest_path: str | Path,
    datasets: list[DatasetConfig],
    cache_cfg: CacheConfig,
    *,
    latent_identity: str,
    text_identity: str,
    pixel_multiple: int,
    paths: RunPaths,
) -> PlanResult:
    """Write one latent spec and one text spec per shard, plus the plan summary.

    Raises:
        ValueError: the manifest is missing or names a dataset the config lacks.
    """
    manifest_path = Path(manifest_path)
    if not manifest_path.is_file():
        raise ValueError(f"manifest {manifest_path} not found; run the validate step first")
    by_name = {d.name: d for d in datasets}
    cols = ["id", "dataset", "path", "sha256", "width", "height", "frames", "caption", "status"]
    rows = pq.read_table(manifest_path, columns=cols).to_pylist()
    names = [shard_name(i) for i in range(cache_cfg.shards)]
    latents: list[list[dict[str, Any]]] = [[] for _ in names]
    texts: list[list[dict[str, Any]]] = [[] for _ in names]
    buckets: Counter[str] = Counter()
    for row in sorted(rows, key=lambda r: r["id"]):
        if row["status"] == "skipped":
            continue
        ds = by_name.get(row["dataset"])
        if ds is None:
            raise ValueError(
                f"manifest {manifest_path} lists dataset {row['dataset']!r}, which is not in the "
                "config; rerun the validate step"
            )
        h, w = choose_bucket(row["width"], row["height"], ds.resolution, pixel_multiple)
        bucket = [row["frames"] or 1, h, w]
        caption = final_caption(ds.caption_prefix, row["caption"])
        s = shard_index(row["id"], cache_cfg.shards)
        latents[s].append(
            {
                "id": row["id"],
                "path": row["path"],
                "sha256": row["sha256"],
                "bucket": bucket,
                "key": latent_key(row["sha256"], bucket, latent_identity, cache_cfg.dtype),
                "repeats": ds.repeats,
                "dataset": ds.name,
            }
        )
        texts[s].append(
            {
                "id": row["id"],
                "caption": caption,
                "key": text_key(caption, text_identity, cache_cfg.dtype),
            }
        )
        buckets[bucket_name(bucket)] += 1

    result = PlanResult(
        items=sum(map(len, latents)), shards=names, buckets=dict(sorted(buckets.items()))
    )
    common = {"version": SPEC_VERSION, "dtype": cache_cfg.dtype}
    for i, name in enumerate(names):
        lspec = {
            **common,
            "kind": "latents",
            "shard": name,
            "identity": latent_identity,
            "items": latents[i],
        }
        tspec = {
            **common,
            "kind": "text",
            "shard": name,
            "identity": text_identity,
            "items": texts[i],
        }
        for path, spec in ((paths.latent_spec(name), lspec), (paths.text_spec(name), tspec)):
            if write_if_changed(path, _spec_json(spec)):
                result.written.append(path)
    for kind in ("latents", "text"):
        for old in sorted((paths.plan_dir / kind).glob("*.json")):
            if old.stem not in names:
                old.unlink()
                result.removed.append(old)
    summary = {
        "items": result.items,
        "buckets": result.buckets,
        "shards": {
            name: {
                "items": len(latents[i]),
                "buckets": dict(
                    sorted(Counter(bucket_name(x["bucket"]) for x in latents[i]).items())
                ),
            }
            for i, name in enumerate(names)
        },
        "dtype": cache_cfg.dtype,
    }
    if write_if_changed(paths.plan_summary, _spec_json(summary)):
        result.written.append(paths.plan_summary)
    return result


def read_spec(path: str | Path) -> dict[str, Any]:
    """Load a spec file, with an error naming it when it is missing or damaged."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"spec {path} not found; run the plan step first") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"spec {path} is not valid JSON ({err}); rerun the plan step") from None
