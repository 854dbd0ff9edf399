"""The cache jobs: build one shard's latents or text embeddings, encoding only what is new.

One Snakemake job per shard and kind. A job reads its spec, looks the keys
up in the content-addressed store (:mod:`diffpipe.data.cache.store`), copies the
rows found there (bit-exact, after checking the store shard's checksum),
loads its encoder once and encodes only the missing entries (latents grouped
by bucket so a batch has one shape), then writes the complete shard into the
store and links it into the run's output, and writes a
``<shard>.summary.json`` beside it with ``encoded``, ``reused`` and
``wall_s``. Decoding runs in worker processes a few batches ahead, so it
overlaps encoding (:mod:`diffpipe.cache_decode`); video clips stream only their planned frames
(:mod:`diffpipe.data.cache.video`). ``regenerate`` ignores the store; ``trust`` skips
re-hashing media files against the sha256 the validate step recorded.

An item with a control image gets it resized and cropped exactly like its
target (same bucket, crop position and flip) and VAE-encoded into the same
entry as conditioning latents; an item with a mask gets it resized and cropped
the same way and area-averaged down to the latent grid (``[1, F, h, w]`` in
[0, 1]). Both images' hashes are part of the entry's key. A dataset with
``control_from_first_frame`` uses each item's own first frame (of the window
trained, already at its bucket and crop) as the control of items without a
control image; ``control_from_last_frame`` appends the window's last frame to
an item's control (``[3, 2, H, W]``: first-and-last-frame conditioning). The
family's ``encode_control`` encodes controls: the plain VAE latents by
default, plus an image-encoder embedding (``control_embeds``) for families
that condition on one. For families whose text encoder sees the
control image (``text_uses_control``) the text job hands each caption's
control image, whole, to ``encode_text``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffpipe import progress as job_progress
from diffpipe.cache_decode import control_image, decode_item, decode_pool, prefetched, source_order
from diffpipe.config import CacheConfig, ModelConfig
from diffpipe.data.cache.latents import (
    AUX_FILL,
    LatentEntry,
    LatentShard,
    aux_array,
    bucket_name,
    storage_to_tensor,
    widened,
    write_latent_shard,
)
from diffpipe.data.cache.plan import EMPTY_ID, read_spec, text_key
from diffpipe.data.cache.store import (
    Store,
    StoreRow,
    shard_content_name,
)
from diffpipe.data.cache.text import TextShard, write_text_shard
from diffpipe.data.dataset.media import DEFAULT_MAX_PIXELS
from diffpipe.data.dataset.tables import parse_locator
from diffpipe.utils import write_text_atomic


def _device(device: str | None) -> torch.device:
    """The device a cache job encodes on, with the CUDA defaults every model-running stage applies."""
    # deferred: models._common loads transformers and diffusers (seconds), which only an encoding job needs
    from diffpipe.models._common import cuda_defaults

    cuda_defaults()
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def latent_mask(mask: np.ndarray | torch.Tensor, latent_shape: tuple[int, ...]) -> torch.Tensor:
    """A pixel mask ``[1, 1, H, W]`` -> ``[1, F, h, w]`` on the latent grid of ``[C, F, h, w]``.

    Area interpolation: each latent cell gets the mean of the pixels it covers
    (exact block means when H / h is whole), repeated over the latent frames.
    """
    m = torch.as_tensor(mask, dtype=torch.float32).reshape(1, 1, *mask.shape[-2:])
    _, f, h, w = latent_shape
    small = torch.nn.functional.interpolate(m, size=(h, w), mode="area")
    return small.reshape(1, 1, h, w).repeat(1, f, 1, 1).clamp(0, 1)


def _check_spec(spec: dict[str, Any], spec_path: Path, identity: str, cache_cfg: CacheConfig) -> None:
    if spec["identity"] != identity:
        raise ValueError(
            f"spec {spec_path} was planned for another model (encoder identity differs); rerun the plan step"
        )
    if spec["dtype"] != cache_cfg.dtype:
        raise ValueError(
            f"spec {spec_path} was planned with dtype {spec['dtype']}, config says {cache_cfg.dtype}; "
            "rerun the plan step"
        )


def _store(store: str | Path | None, cache_cfg: CacheConfig, out_path: Path) -> Store:
    # Default: cache.dir, else <output_dir>/cache/store (out_path is <output_dir>/cache/<kind>/<shard>).
    if store is None:
        store = cache_cfg.dir or out_path.parent.parent / "store"
    return Store(store)


def _write_summary(out_path: Path, summary: dict[str, Any]) -> None:
    write_text_atomic(Path(f"{out_path}.summary.json"), json.dumps(summary, indent=1, sort_keys=True) + "\n")


def _by_shard(found: dict[str, StoreRow]) -> dict[Path, list[tuple[str, StoreRow]]]:
    groups: dict[Path, list[tuple[str, StoreRow]]] = {}
    for key, row in sorted(found.items()):
        groups.setdefault(row.shard, []).append((key, row))
    return groups


def _reuse_latents(found: dict[str, StoreRow], dtype: str, damaged: list[str]) -> dict[str, dict[str, torch.Tensor | None]]:
    """Rows of the store (``latents`` and aux arrays), bit-exact; the names of store shards
    that fail their checksum go to ``damaged`` (removed when the job publishes)."""
    out: dict[str, dict[str, torch.Tensor | None]] = {}
    for shard_path, rows in _by_shard(found).items():
        try:
            shard = LatentShard(shard_path)
            if shard.dtype != dtype:
                continue
            arrays = shard.load()  # whole arrays: one read call per bucket; checksum checked
        except ValueError:
            damaged.append(shard_path.name.removesuffix(".zarr"))
            continue
        for key, row in rows:
            # float32 like fresh encodes; bf16 -> fp32 -> bf16 is exact.
            value = {"latents": storage_to_tensor(arrays[row.array][row.row], dtype).float()}
            for role in AUX_FILL:
                meta = shard.aux_meta.get(name := aux_array(role, row.array))
                has = meta is not None and meta["has"][row.row]
                value[role] = storage_to_tensor(arrays[name][row.row], dtype).float() if has else None
            out[key] = value
    return out


def _reuse_text(found: dict[str, StoreRow], dtype: str, damaged: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for shard_path, rows in _by_shard(found).items():
        try:
            shard = TextShard(shard_path)
            if shard.dtype != dtype:
                continue
            arrays = shard.load()
        except ValueError:
            damaged.append(shard_path.name.removesuffix(".arrow"))
            continue
        for key, row in rows:
            out[key] = {name: storage_to_tensor(a[row.row], dtype) for name, a in arrays.items()}
    return out


def _index_rows(entries: list[LatentEntry]) -> list[tuple[str, str, int]]:
    """``(key, array, row)`` of each entry, in the order :func:`write_latent_shard` stores them."""
    groups: dict[str, list[LatentEntry]] = {}
    for e in entries:
        groups.setdefault(bucket_name(e.bucket), []).append(e)
    return [(e.key, arr, r) for arr, g in groups.items() for r, e in enumerate(sorted(g, key=lambda e: e.id))]


def cache_latents(spec_path: str | Path, out_path: str | Path, model_cfg: ModelConfig, cache_cfg: CacheConfig, *,
                  store: str | Path | None = None, regenerate: bool = False, trust: bool = False,
                  device: str | None = None, workers: int | None = None) -> dict[str, Any]:
    """Build the Zarr shard of one latent spec, encoding only keys the store lacks; returns the summary.

    Steps: reuse what the store holds (:func:`_stored_latents`), decode and encode the rest
    (:func:`_encode_latents`), publish the shard (:func:`_publish_latents`).
    """
    from diffpipe.families import get_family  # heavy imports only when a job runs

    start = time.perf_counter()
    spec_path, out_path = Path(spec_path), Path(out_path)
    spec = read_spec(spec_path)
    items: list[dict[str, Any]] = spec["items"]
    family = get_family(model_cfg)
    _check_spec(spec, spec_path, family.vae_identity(), cache_cfg)
    st = _store(store, cache_cfg, out_path)
    first: dict[str, dict[str, Any]] = {}
    for item in items:  # equal keys, equal latents: encode each key once
        first.setdefault(item["key"], item)
    damaged: list[str] = []
    values = {} if regenerate else _stored_latents(st, first, spec["dtype"], damaged)
    reused = len(values)
    missing = [item for key, item in first.items() if key not in values]
    timing = _encode_latents(family, spec, missing, values, cache_cfg, trust=trust, device=device, workers=workers)
    target, counts = _publish_latents(st, spec, items, values, out_path, rewrite=regenerate or bool(missing),
                                      damaged=damaged)
    summary = {
        "kind": "latents",
        "shard": spec["shard"],
        "items": len(items),
        "encoded": len(missing),
        "reused": reused,
        "buckets": counts,
        "dtype": spec["dtype"],
        "store": str(target),
        **timing,
        "wall_s": round(time.perf_counter() - start, 3),
    }
    _write_summary(out_path, summary)
    return summary


def _stored_latents(st: Store, first: dict[str, dict[str, Any]], dtype: str, damaged: list[str]) -> dict[str, Any]:
    """The entries the store already holds for these keys (damaged shards named in ``damaged``); an entry
    lacking an aux array its key promises (mask, control) is left out, so it is encoded again."""
    with st.lock():  # no store shard goes while it is read
        values = _reuse_latents(st.lookup("latents", first), dtype, damaged)
    for key in list(values):
        if any(values[key][role] is None for role in first[key].get("aux") or {}):
            del values[key]
    return values


def _encode_latents(family, spec: dict[str, Any], missing: list[dict[str, Any]], values: dict[str, Any],
                    cache_cfg: CacheConfig, *, trust: bool, device: str | None, workers: int | None) -> dict[str, float]:
    """Decode the ``missing`` items in worker processes, batched per bucket, and encode them with the VAE into
    ``values``; returns the seconds spent waiting for decoding and encoding."""
    if any(parse_locator(item["path"]) for item in missing):
        # Table rows in table order: a Parquet row group is read once, not once per item.
        missing = sorted(missing, key=source_order)
    by_bucket: dict[tuple[int, ...], list[dict[str, Any]]] = {}
    for item in missing:
        by_bucket.setdefault(tuple(item["bucket"]), []).append(item)
    bs = cache_cfg.batch_size
    batches = [g[i : i + bs] for _, g in sorted(by_bucket.items()) for i in range(0, len(g), bs)]
    wait = encode_s = 0.0
    if missing:  # a shard whose entries are all stored needs no VAE
        dev = _device(device)
        n_workers = cache_cfg.workers if workers is None else workers
        with decode_pool(len(batches), n_workers) as pool:
            # Submitting first lets worker start-up and decoding overlap loading the VAE.
            limit = spec.get("max_pixels", DEFAULT_MAX_PIXELS)  # specs planned before it was recorded
            stream = prefetched(([(x, trust, limit) for x in b] for b in batches), decode_item, pool)
            vae = family.load_vae().to(dev)
            # Items encoded of those missing (reused entries take no time): the status file and progress line.
            with job_progress.start(len(missing), unit="item", stage="cache latents",
                                    shard=spec["shard"]) as progress, torch.no_grad():
                t0, done = time.perf_counter(), 0
                for jobs, decoded in stream:
                    t1 = time.perf_counter()
                    wait += t1 - t0
                    x = torch.from_numpy(np.stack([d["pixels"] for d in decoded])).to(dev)
                    latents = family.encode_pixels(vae, x).float().cpu()
                    controls = _encode_controls(family, vae, decoded, dev, frames=x.shape[2])
                    encode_s += time.perf_counter() - t1
                    for (item, *_), d, lat, ctrl in zip(jobs, decoded, latents, controls, strict=True):
                        mask = d.get("mask")
                        values[item["key"]] = {
                            "latents": lat,
                            "mask": None if mask is None else latent_mask(mask, tuple(lat.shape)),
                            **ctrl,
                        }
                    done += len(jobs)
                    progress.update(done)
                    t0 = time.perf_counter()
    return {"decode_wait_s": round(wait, 3), "encode_s": round(encode_s, 3)}


def _publish_latents(st: Store, spec: dict[str, Any], items: list[dict[str, Any]], values: dict[str, Any],
                     out_path: Path, *, rewrite: bool, damaged: list[str]) -> tuple[Path, dict[str, int]]:
    """Write the shard of every item (in spec order) into the store and link it at ``out_path``;
    returns where it is and its entry count per array."""
    entries = [
        LatentEntry(
            it["id"],
            it["key"],
            tuple(it["bucket"]),
            values[it["key"]]["latents"],
            values[it["key"]]["mask"],
            values[it["key"]]["control"],
            values[it["key"]].get("control_embeds"),
        )
        for it in items
    ]
    dtype, attrs = spec["dtype"], {"identity": spec["identity"]}
    name = shard_content_name("latents", dtype, [(it["id"], it["key"]) for it in items])
    rows = _index_rows(entries)

    def write(path: Path) -> None:
        write_latent_shard(path, entries, dtype=dtype, attrs=attrs)

    target = st.publish("latents", name, out_path, write, rows, rewrite=rewrite, damaged=damaged)
    counts: dict[str, int] = {}
    for _, arr, _ in rows:
        counts[arr] = counts.get(arr, 0) + 1
    return target, counts


def _encode_controls(family, vae, decoded: list[dict[str, np.ndarray]], dev, *, frames: int) -> list[dict]:
    """Each item's ``control`` (conditioning latents) and ``control_embeds`` (None without a control).

    ``frames`` is the batch's clip length: families that condition a whole clip
    on one image build their conditioning at the target's length.
    """
    out: list[dict] = [{"control": None, "control_embeds": None} for _ in decoded]
    by_shape: dict[tuple[int, ...], list[int]] = {}  # one frame, or first + last (datasets may differ)
    for i, d in enumerate(decoded):
        if "control" in d:
            by_shape.setdefault(d["control"].shape, []).append(i)
    for have in by_shape.values():
        x = torch.from_numpy(np.stack([decoded[i]["control"] for i in have])).to(dev)
        for name, values in family.encode_control(vae, x, frames=frames).items():
            for i, v in zip(have, values.float().cpu(), strict=True):
                out[i][name] = v
    return out


def _encode_captions(
    family,
    encoders,
    captions: list[str],
    bs: int,
    shard: str,
    controls: list[dict[str, str] | list[dict[str, str]] | None] | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> dict[str, torch.Tensor]:
    """Embeddings of ``captions``; with ``controls`` (families whose text encoder sees the
    control image) each caption is encoded with its item's control image."""
    parts: dict[str, list[torch.Tensor]] = {}
    with job_progress.start(len(captions), unit="caption", stage="cache text", shard=shard) as progress, torch.no_grad():
        for i in range(0, len(captions), bs):
            if controls is None:
                out = family.encode_text(encoders, captions[i : i + bs])
            else:
                images = [c and control_image(c, max_pixels) for c in controls[i : i + bs]]
                out = family.encode_text(encoders, captions[i : i + bs], images=images)
            for name, t in out.items():
                parts.setdefault(name, []).append((t.float() if t.is_floating_point() else t).cpu())
            progress.update(min(i + bs, len(captions)))
    return {name: torch.cat(ts) for name, ts in parts.items()}


def _load_encoders(family, device: str | None):
    encoders = family.load_text_encoders()
    if hasattr(encoders, "to"):
        encoders = encoders.to(_device(device)) or encoders
    return encoders


def _cache_text_spec(
    spec: dict[str, Any],
    out_path: Path,
    family,
    cache_cfg: CacheConfig,
    st: Store,
    *,
    regenerate: bool,
    device: str | None,
) -> dict[str, Any]:
    start = time.perf_counter()
    items: list[dict[str, Any]] = spec["items"]
    dtype = spec["dtype"]
    unique: dict[str, str] = {}
    controls: dict[str, dict[str, str] | list[dict[str, str]] | None] = {}
    for item in items:  # equal keys, equal embeddings: encode each caption once
        unique.setdefault(item["key"], item["caption"])
        controls.setdefault(item["key"], item.get("control"))
    damaged: list[str] = []
    values = {}
    if not regenerate:
        with st.lock():
            values = _reuse_text(st.lookup("text", unique), dtype, damaged)
    reused = len(values)
    missing = [key for key in unique if key not in values]
    if missing:
        uses_control = getattr(family, "text_uses_control", False)
        values.update(_encode_missing_text(family, spec, cache_cfg, device, {k: unique[k] for k in missing},
                                           [controls[k] for k in missing] if uses_control else None))
    target = _publish_text(st, spec, values, out_path, rewrite=regenerate or bool(missing), damaged=damaged)
    summary = {
        "kind": "text",
        "shard": spec["shard"],
        "items": len(items),
        "encoded": len(missing),
        "reused": reused,
        "dtype": dtype,
        "store": str(target),
        "wall_s": round(time.perf_counter() - start, 3),
    }
    _write_summary(out_path, summary)
    return summary


def _encode_missing_text(family, spec: dict[str, Any], cache_cfg: CacheConfig, device: str | None,
                         captions: dict[str, str], controls: list | None) -> dict[str, dict[str, torch.Tensor]]:
    """Key -> embeddings of the captions the store lacks (``controls``: their control images, for a family
    whose text encoder sees them)."""
    encoders = _load_encoders(family, device)
    encoded = _encode_captions(
        family,
        encoders,
        list(captions.values()),
        cache_cfg.batch_size,
        spec["shard"],
        controls,
        spec.get("max_pixels", DEFAULT_MAX_PIXELS),
    )
    return {key: {name: t[i] for name, t in encoded.items()} for i, key in enumerate(captions)}


def _publish_text(st: Store, spec: dict[str, Any], values: dict[str, dict[str, torch.Tensor]], out_path: Path, *,
                  rewrite: bool, damaged: list[str]) -> Path:
    """The spec's text shard (items in the spec's order) in the store, linked at ``out_path``: its store path."""
    items: list[dict[str, Any]] = spec["items"]
    dtype = spec["dtype"]
    embeddings: dict[str, torch.Tensor] = {}
    if items:
        names = sorted(values[items[0]["key"]])
        embeddings = {n: torch.stack([widened(values[it["key"]][n]) for it in items]) for n in names}
    name = shard_content_name("text", dtype, [(it["id"], it["key"]) for it in items])

    def write(path: Path) -> None:
        ids, keys = [it["id"] for it in items], [it["key"] for it in items]
        write_text_shard(path, ids, keys, embeddings, dtype=dtype, attrs={"identity": spec["identity"]})

    rows = [(it["key"], "", r) for r, it in enumerate(items)]
    return st.publish("text", name, out_path, write, rows, rewrite=rewrite, damaged=damaged)


def cache_text(spec_path: str | Path, out_path: str | Path, model_cfg: ModelConfig, cache_cfg: CacheConfig, *,
               store: str | Path | None = None, regenerate: bool = False, device: str | None = None,
               trained_text: list[str] | tuple[str, ...] = (), run_root: str | Path | None = None) -> dict[str, Any]:
    """Build the Arrow shard of one text spec, encoding only captions the store lacks; returns the summary.

    ``trained_text`` (``train.text_encoder.encoders``): encoders whose captions are cached as token ids.
    ``run_root``: the run folder holding ``model.base_loras`` read in (:func:`_text_family`)."""
    start = time.perf_counter()
    spec_path, out_path = Path(spec_path), Path(out_path)
    spec = read_spec(spec_path)
    family = _text_family(model_cfg, trained_text, run_root)
    _check_spec(spec, spec_path, family.text_identity(), cache_cfg)
    return _finish_text_job(spec, out_path, family, cache_cfg, store, regenerate=regenerate, device=device, start=start)


def _text_family(model_cfg: ModelConfig, trained_text: list[str] | tuple[str, ...], run_root: str | Path | None):
    """The family encoding the captions: ``trained_text``'s captions as token ids, the base LoRAs' text-encoder
    parts folded into the encoders (read into ``run_root``'s ``base_loras/`` once)."""
    from diffpipe.export.base_loras import text_base_loras  # heavy imports only when a job runs
    from diffpipe.families import get_family

    family = get_family(model_cfg).with_trained_text(trained_text)
    if not model_cfg.base_loras:
        return family
    if run_root is None:
        raise ValueError("model.base_loras: the text cache jobs need the run folder to read them into (run_root)")
    return text_base_loras(family, run_root)


def _finish_text_job(spec: dict[str, Any], out_path: Path, family: Any, cache_cfg: CacheConfig,
                     store: str | Path | None, *, regenerate: bool, device: str | None,
                     start: float) -> dict[str, Any]:
    """Encode a checked text spec into ``out_path`` and write its summary (with the job's wall time)."""
    summary = _cache_text_spec(spec, out_path, family, cache_cfg, _store(store, cache_cfg, out_path),
                               regenerate=regenerate, device=device)
    summary["wall_s"] = round(time.perf_counter() - start, 3)
    _write_summary(out_path, summary)
    return summary


def cache_empty_text(
    out_path: str | Path,
    model_cfg: ModelConfig,
    cache_cfg: CacheConfig,
    *,
    spec_path: str | Path | None = None,
    store: str | Path | None = None,
    regenerate: bool = False,
    device: str | None = None,
    trained_text: list[str] | tuple[str, ...] = (),
    run_root: str | Path | None = None,
) -> dict[str, Any]:
    """Encode the empty caption once (for caption dropout) into a one-row text shard.

    ``spec_path`` is the plan's ``empty.json``; without it the spec is built here. ``trained_text``,
    ``run_root``: as :func:`cache_text`.
    """
    start = time.perf_counter()
    out_path = Path(out_path)
    family = _text_family(model_cfg, trained_text, run_root)
    identity = family.text_identity()
    if spec_path is not None:
        spec = read_spec(spec_path)
        _check_spec(spec, Path(spec_path), identity, cache_cfg)
    else:
        key = text_key("", identity, cache_cfg.dtype)
        spec = {
            "kind": "text",
            "shard": "empty",
            "identity": identity,
            "dtype": cache_cfg.dtype,
            "items": [{"id": EMPTY_ID, "caption": "", "key": key}],
        }
    return _finish_text_job(spec, out_path, family, cache_cfg, store, regenerate=regenerate, device=device, start=start)
