"""The cache jobs: encode one shard's images or captions and write the shard.

One Snakemake job per shard and kind. Each job loads its encoder once,
encodes in batches of ``cache.batch_size`` (latents grouped by bucket so a
batch has one shape), writes the shard atomically and a
``<shard>.summary.json`` beside it. Image decoding runs in a thread pool a
few batches ahead, so it overlaps encoding.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from diffpipe.config import CacheConfig, ModelConfig
from diffpipe.data.buckets import load_image
from diffpipe.data.latents import LatentEntry, write_latent_shard
from diffpipe.data.plan import read_spec, text_key
from diffpipe.data.text import write_text_shard
from diffpipe.utils import write_text_atomic

T = TypeVar("T")
R = TypeVar("R")
EMPTY_ID = "__empty__"
#: Batches decoded ahead of the encoder.
PREFETCH = 2


def _device(device: str | None) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()
    )


def _prefetched(
    batches: Iterable[list[T]], fn: Callable[[T], R], workers: int
) -> Iterator[tuple[list[T], list[R]]]:
    """Yield ``(batch, [fn(x) for x in batch])`` with later batches already running."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        it = iter(batches)
        pending: deque = deque()
        for batch in itertools.islice(it, PREFETCH + 1):
            pending.append((batch, [pool.submit(fn, x) for x in batch]))
        while pending:
            batch, futures = pending.popleft()
            nxt = next(it, None)
            if nxt is not None:
                pending.append((nxt, [pool.submit(fn, x) for x in nxt]))
            yield batch, [f.result() for f in futures]


def _load_item(item: dict[str, Any]) -> torch.Tensor:
    """Read, check against the planned sha256, decode to the item's bucket."""
    path = item["path"]
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err}; rerun the validate step") from err
    if hashlib.sha256(data).hexdigest() != item["sha256"]:
        # Encoding it would store new pixels under the old content's key.
        raise ValueError(f"{path} changed since validation (sha256 differs); rerun the workflow")
    _, h, w = item["bucket"]
    try:
        return load_image(io.BytesIO(data), (h, w))
    except Exception as err:
        raise ValueError(f"cannot decode {path}: {err}") from err


def _check_spec(
    spec: dict[str, Any], spec_path: Path, identity: str, cache_cfg: CacheConfig
) -> None:
    if spec["identity"] != identity:
        raise ValueError(
            f"spec {spec_path} was planned for another model (encoder identity differs); rerun the plan step"
        )
    if spec["dtype"] != cache_cfg.dtype:
        raise ValueError(
            f"spec {spec_path} was planned with dtype {spec['dtype']}, config says {cache_cfg.dtype}; "
            "rerun the plan step"
        )


def _write_summary(out_path: Path, summary: dict[str, Any]) -> None:
    write_text_atomic(
        Path(f"{out_path}.summary.json"), json.dumps(summary, indent=1, sort_keys=True) + "\n"
    )


def cache_latents(
    spec_path: str | Path,
    out_path: str | Path,
    model_cfg: ModelConfig,
    cache_cfg: CacheConfig,
    *,
    device: str | None = None,
    workers: int | None = None,
) -> dict[str, Any]:
    """Encode the images of one latent spec into a Zarr shard; returns the summary."""
    from diffpipe.models import get_family  # heavy imports only when a job runs

    start = time.perf_counter()
    spec_path, out_path = Path(spec_path), Path(out_path)
    spec = read_spec(spec_path)
    items: list[dict[str, Any]] = spec["items"]
    family = get_family(model_cfg)
    _check_spec(spec, spec_path, family.vae_identity(), cache_cfg)

    by_bucket: dict[tuple[int, ...], list[dict[str, Any]]] = {}
    for item in items:
        by_bucket.setdefault(tuple(item["bucket"]), []).append(item)
    bs = cache_cfg.batch_size
    batches = [
        group[i : i + bs]
        for _, group in sorted(by_bucket.items())
        for i in range(0, len(group), bs)
    ]

    entries: list[LatentEntry] = []
    wait = 0.0
    if items:  # an empty shard needs no VAE
        dev = _device(device)
        vae = family.load_vae().to(dev)
        n_workers = workers or min(4, os.cpu_count() or 1)
        with _progress() as progress, torch.no_grad():
            task = progress.add_task(f"latents {spec['shard']}", total=len(items))
            t0 = time.perf_counter()
            for batch, pixels in _prefetched(batches, _load_item, n_workers):
                wait += time.perf_counter() - t0
                latents = family.encode_pixels(vae, torch.stack(pixels).to(dev)).float().cpu()
                for item, lat in zip(batch, latents, strict=True):
                    entries.append(LatentEntry(item["id"], item["key"], tuple(item["bucket"]), lat))
                progress.advance(task, len(batch))
                t0 = time.perf_counter()
    counts = write_latent_shard(
        out_path,
        entries,
        dtype=spec["dtype"],
        attrs={"identity": spec["identity"], "shard": spec["shard"]},
    )
    summary = {
        "kind": "latents",
        "shard": spec["shard"],
        "items": len(items),
        "encoded": len(entries),
        "reused": 0,
        "buckets": counts,
        "dtype": spec["dtype"],
        "decode_wait_s": round(wait, 3),
        "wall_s": round(time.perf_counter() - start, 3),
    }
    _write_summary(out_path, summary)
    return summary


def _encode_captions(
    family, encoders, captions: list[str], bs: int, label: str
) -> dict[str, torch.Tensor]:
    parts: dict[str, list[torch.Tensor]] = {}
    with _progress() as progress, torch.no_grad():
        task = progress.add_task(label, total=len(captions))
        for i in range(0, len(captions), bs):
            out = family.encode_text(encoders, captions[i : i + bs])
            for name, t in out.items():
                parts.setdefault(name, []).append(t.float().cpu())
            progress.advance(task, len(captions[i : i + bs]))
    return {name: torch.cat(ts) for name, ts in parts.items()}


def _load_encoders(family, device: str | None):
    encoders = family.load_text_encoders()
    if hasattr(encoders, "to"):
        encoders = encoders.to(_device(device)) or encoders
    return encoders


def cache_text(
    spec_path: str | Path,
    out_path: str | Path,
    model_cfg: ModelConfig,
    cache_cfg: CacheConfig,
    *,
    device: str | None = None,
) -> dict[str, Any]:
    """Encode the captions of one text spec into an Arrow shard; returns the summary."""
    from diffpipe.models import get_family

    start = time.perf_counter()
    spec_path, out_path = Path(spec_path), Path(out_path)
    spec = read_spec(spec_path)
    items: list[dict[str, Any]] = spec["items"]
    family = get_family(model_cfg)
    _check_spec(spec, spec_path, family.text_identity(), cache_cfg)

    # Equal keys mean equal embeddings: encode each distinct caption once.
    unique: dict[str, str] = {}
    for item in items:
        unique.setdefault(item["key"], item["caption"])
    embeddings: dict[str, torch.Tensor] = {}
    if items:
        encoders = _load_encoders(family, device)
        encoded = _encode_captions(
            family, encoders, list(unique.values()), cache_cfg.batch_size, f"text {spec['shard']}"
        )
        row = {key: i for i, key in enumerate(unique)}
        index = torch.tensor([row[item["key"]] for item in items], dtype=torch.long)
        embeddings = {name: t[index] for name, t in encoded.items()}
    write_text_shard(
        out_path,
        [item["id"] for item in items],
        [item["key"] for item in items],
        embeddings,
        dtype=spec["dtype"],
        attrs={"identity": spec["identity"], "shard": spec["shard"]},
    )
    summary = {
        "kind": "text",
        "shard": spec["shard"],
        "items": len(items),
        "encoded": len(unique),
        "reused": 0,
        "dtype": spec["dtype"],
        "wall_s": round(time.perf_counter() - start, 3),
    }
    _write_summary(out_path, summary)
    return summary


def cache_empty_text(
    out_path: str | Path,
    model_cfg: ModelConfig,
    cache_cfg: CacheConfig,
    *,
    device: str | None = None,
) -> dict[str, Any]:
    """Encode the empty caption once (for caption dropout) into a one-row text shard."""
    from diffpipe.models import get_family

    start = time.perf_counter()
    family = get_family(model_cfg)
    identity = family.text_identity()
    encoders = _load_encoders(family, device)
    with torch.no_grad():
        out = {name: t.float().cpu() for name, t in family.encode_text(encoders, [""]).items()}
    key = text_key("", identity, cache_cfg.dtype)
    write_text_shard(
        out_path,
        [EMPTY_ID],
        [key],
        out,
        dtype=cache_cfg.dtype,
        attrs={"identity": identity, "shard": "empty"},
    )
    summary = {
        "kind": "text",
        "shard": "empty",
        "items": 1,
        "encoded": 1,
        "reused": 0,
        "dtype": cache_cfg.dtype,
        "wall_s": round(time.perf_counter() - start, 3),
    }
    _write_summary(Path(out_path), summary)
    return summary
