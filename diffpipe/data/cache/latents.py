"""Latent cache shards: one Zarr v3 group per shard, one array per bucket.

Layout of ``<shard>.zarr``::

    zarr.json                 group attrs: format, version, dtype, identity,
                              checksum (sha256 over every array's bytes)
    1x64x64/                  array [N, C, F, h, w] for pixel bucket F x H x W
        attrs: bucket, ids, keys, dtype
    mask/1x64x64/             loss masks [N, 1, F, h, w] in [0, 1] at latent resolution,
        attrs: ids, has       rows aligned with the bucket's (ones where ``has`` is false)
    control/1x64x64/          control latents [N, C, F_c, h, w] (zeros where ``has`` is false)
    control_embeds/1x64x64/   image-encoder embeddings of the control images [N, ...] (families
                              that condition on one, e.g. Wan 2.1 I2V's CLIP hidden states)

The ``mask``, ``control`` and ``control_embeds`` groups exist only when some item has one.

bfloat16 is stored as its raw uint16 bits (Zarr has no bf16 dtype) with
``{"dtype": "bfloat16"}`` in the attrs, so the round trip is bit-exact.
Chunks hold a block of whole rows, so a batch or a whole bucket is a few reads.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr

from diffpipe.utils import atomic_path, stable_json

FORMAT = "diffpipe-latents"
VERSION = 1
DTYPES = ("float32", "bfloat16")
#: Target bytes per chunk; a chunk holds whole rows.
CHUNK_BYTES = 8 << 20


#: Per-item arrays stored beside the latents: role -> value of rows without one.
AUX_FILL = {"mask": 1.0, "control": 0.0, "control_embeds": 0.0}


@dataclass(frozen=True)
class LatentEntry:
    """One encoded item: its id, cache key, pixel bucket ``(F, H, W)`` and latents ``[C, F, h, w]``.

    ``mask`` (``[1, F, h, w]`` in [0, 1]) and ``control`` (conditioning latents
    ``[C, F_c, h, w]``) are the item's auxiliary arrays, None when it has none;
    ``control_embeds`` is the control image's image-encoder embedding, for
    families whose ``encode_control`` returns one.
    """

    id: str
    key: str
    bucket: tuple[int, int, int]
    latents: torch.Tensor
    mask: torch.Tensor | None = None
    control: torch.Tensor | None = None
    control_embeds: torch.Tensor | None = None


def aux_array(role: str, bucket_array: str) -> str:
    """Path of a bucket's aux array inside a shard: ``mask/1x64x64``."""
    return f"{role}/{bucket_array}"


def bucket_name(bucket: tuple[int, int, int] | list[int]) -> str:
    """Array name of a pixel bucket: ``"FxHxW"``."""
    return "x".join(str(int(v)) for v in bucket)


def to_storage(t: torch.Tensor, dtype: str) -> np.ndarray:
    """Tensor -> numpy array in the storage dtype (bf16 as uint16 bits); integer tensors (token ids of a trained
    text encoder's captions) as int32 whatever the dtype."""
    if not t.is_floating_point():
        return t.detach().cpu().to(torch.int32).contiguous().numpy()
    if dtype == "bfloat16":
        return t.detach().cpu().to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
    if dtype == "float32":
        return t.detach().cpu().to(torch.float32).contiguous().numpy()
    raise ValueError(f"unsupported cache dtype {dtype!r}; use one of {DTYPES}")


def from_storage(arr: np.ndarray, dtype: str) -> np.ndarray:
    """Stored array -> float32 numpy (bf16 bits widened exactly); int32 arrays (token ids) as they are."""
    if arr.dtype == np.int32:
        return arr
    if dtype == "bfloat16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return np.asarray(arr, dtype=np.float32)


def storage_to_tensor(arr: np.ndarray, dtype: str) -> torch.Tensor:
    """Stored array -> tensor in its compute dtype (bf16 stays bf16: half the memory; int32 token ids: int64)."""
    if arr.dtype == np.int32:
        return torch.from_numpy(arr.astype(np.int64))
    if not arr.flags.writeable:  # memory-mapped or zarr-owned buffers: torch needs its own
        arr = arr.copy()
    if dtype == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))


def widened(t: torch.Tensor) -> torch.Tensor:
    """Embeddings as float32; token ids (a trained text encoder's captions) stay integers."""
    return t.float() if t.is_floating_point() else t


def _checksum(arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(stable_json([name, list(a.shape), a.dtype.str, meta[name]]).encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


def write_latent_shard(
    out_path: str | Path,
    entries: Iterable[LatentEntry],
    *,
    dtype: str = "float32",
    attrs: dict[str, Any] | None = None,
) -> dict[str, int]:
    """Write a shard atomically; returns the item count per array.

    ``attrs`` (e.g. the VAE identity) are stored in the group attributes.
    Items inside an array are sorted by id, so equal inputs give equal files.
    """
    groups: dict[str, list[LatentEntry]] = {}
    for e in entries:
        groups.setdefault(bucket_name(e.bucket), []).append(e)
    arrays: dict[str, np.ndarray] = {}
    meta: dict[str, dict[str, Any]] = {}
    for name, items in sorted(groups.items()):
        items.sort(key=lambda e: e.id)
        _add_bucket(arrays, meta, out_path, name, items, dtype)
    group_attrs = {
        **(attrs or {}),
        "format": FORMAT,
        "version": VERSION,
        "dtype": dtype,
        "checksum": _checksum(arrays, meta),
    }
    _write_group(out_path, arrays, meta, group_attrs)
    return {name: len(a) for name, a in arrays.items()}


def _add_bucket(
    arrays: dict[str, np.ndarray],
    meta: dict[str, dict[str, Any]],
    out_path: str | Path,
    name: str,
    items: list[LatentEntry],
    dtype: str,
) -> None:
    """One bucket's latents array and, per aux role any item has, its aux array (blank rows where an item has
    none), with their attributes."""
    shapes = {tuple(e.latents.shape) for e in items}
    if len(shapes) != 1:
        raise ValueError(f"latent shard {out_path}: bucket {name} mixes shapes {sorted(shapes)}")
    arrays[name] = to_storage(torch.stack([e.latents for e in items]), dtype)
    meta[name] = {
        "bucket": list(items[0].bucket),
        "ids": [e.id for e in items],
        "keys": [e.key for e in items],
        "dtype": dtype,
    }
    for role, fill in AUX_FILL.items():
        values = [getattr(e, role) for e in items]
        present = [v for v in values if v is not None]
        if not present:
            continue
        shapes = {tuple(v.shape) for v in present}
        if len(shapes) != 1:
            raise ValueError(f"latent shard {out_path}: bucket {name} mixes {role} shapes {sorted(shapes)}")
        blank = torch.full(present[0].shape, fill)
        rows = [blank if v is None else v for v in values]
        arrays[aux_array(role, name)] = to_storage(torch.stack(rows), dtype)
        meta[aux_array(role, name)] = {
            "ids": meta[name]["ids"],
            "has": [v is not None for v in values],
            "dtype": dtype,
        }


def _write_group(
    out_path: str | Path, arrays: dict[str, np.ndarray], meta: dict[str, dict[str, Any]], group_attrs: dict[str, Any]
) -> None:
    """The Zarr group at ``out_path``, written atomically: each array with its attributes, the group's last."""
    with atomic_path(out_path, is_dir=True) as tmp:
        group = zarr.open_group(str(tmp), mode="w", zarr_format=3)
        for name, data in arrays.items():
            row_bytes = max(1, data[0].nbytes)
            rows = max(1, min(len(data), CHUNK_BYTES // row_bytes))
            arr = group.create_array(  # "mask/1x64x64" creates the "mask" group too
                name,
                shape=data.shape,
                chunks=(rows, *data.shape[1:]),
                dtype=data.dtype,
                # Flat chunk names (c.0.0.0.0.0): one file per chunk, no folder tree to create and delete.
                chunk_key_encoding={"name": "default", "separator": "."},
                # Latents are near-incompressible noise; compression only costs time.
                compressors=None,
                attributes=meta[name],
            )
            arr[...] = data
        # The checksum goes in last, so a reader never sees it without the data.
        group.attrs.update(group_attrs)


#: Files in a shard folder that are not Zarr's: Snakemake's stamp in directory outputs,
#: diffpipe's own-output marker (``utils.OUTPUT_MARKER``). Zarr warns about each.
_NOT_ZARR = r".*(\.snakemake_timestamp|\.diffpipe-output\.json).*"


def _arrays(folder: Path) -> list[str]:
    """The arrays directly in a Zarr group folder, from their own metadata files.

    Read here rather than through zarr's member listing, which also tries every
    other file there (diffpipe's output marker) concurrently: when one array's
    metadata is damaged, those tries are left failing unobserved and asyncio
    prints their tracebacks.
    """
    out = []
    for child in sorted(folder.iterdir()):
        meta = child / "zarr.json"
        if meta.is_file() and json.loads(meta.read_text()).get("node_type") == "array":
            out.append(child.name)
    return out


class LatentShard:
    """Read side of a latent shard; ``load()`` reads each array in one call."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not (self.path / "zarr.json").is_file():
            raise ValueError(f"latent shard {self.path} is missing; run the cache step for it")
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_NOT_ZARR)
                self.group = zarr.open_group(str(self.path), mode="r")
                self.attrs: dict[str, Any] = dict(self.group.attrs)
                if self.attrs.get("format") != FORMAT:
                    raise ValueError(f"latent shard {self.path} is not a diffpipe latent shard (no format attr)")
                self.dtype: str = self.attrs["dtype"]
                self.meta: dict[str, dict[str, Any]] = {
                    name: dict(self.group[name].attrs) for name in _arrays(self.path)
                }
                #: Aux arrays (``mask/1x64x64``, ``control/...``) -> attrs (``ids``, ``has``).
                self.aux_meta: dict[str, dict[str, Any]] = {
                    aux_array(role, name): dict(self.group[role][name].attrs)
                    for role in AUX_FILL
                    if (self.path / role / "zarr.json").is_file()
                    for name in _arrays(self.path / role)
                }
        except Exception as err:  # zarr raises many types for a damaged store
            raise self._damaged(err) from None

    def _damaged(self, err: Exception) -> ValueError:
        """A ValueError naming the shard, its first unreadable metadata file, and the fix."""
        if isinstance(err, ValueError) and str(err).startswith(f"latent shard {self.path}"):
            return err
        bad = None
        for meta in sorted(self.path.rglob("zarr.json")):
            try:
                json.loads(meta.read_text())
            except (OSError, ValueError):
                bad = meta
                break
        where = f"its metadata file {bad} is damaged" if bad else f"it cannot be opened ({type(err).__name__}: {err})"
        return ValueError(f"latent shard {self.path}: {where}; delete the shard folder and rerun its cache job "
                          "(`diffpipe run` does)")

    @property
    def names(self) -> list[str]:
        return list(self.meta)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.group[name].shape)

    def read_raw(self, name: str) -> np.ndarray:
        """The stored array (uint16 bits for bf16)."""
        try:
            return self.group[name][...]
        except Exception as err:
            raise ValueError(f"latent shard {self.path}: array {name} cannot be read: {err}") from err

    def read(self, name: str) -> np.ndarray:
        """Array ``name`` as float32 ``[N, C, F, h, w]``."""
        return from_storage(self.read_raw(name), self.dtype)

    def load(self) -> dict[str, np.ndarray]:
        """Every array in storage form (buckets and aux arrays), checked against the shard checksum."""
        arrays = {name: self.read_raw(name) for name in [*self.names, *self.aux_meta]}
        self._check(arrays)
        return arrays

    def verify(self) -> bool:
        """Recompute the checksum; raises ValueError naming the shard on mismatch."""
        self.load()
        return True

    def _check(self, arrays: dict[str, np.ndarray]) -> None:
        if _checksum(arrays, {**self.meta, **self.aux_meta}) != self.attrs.get("checksum"):
            raise ValueError(
                f"latent shard {self.path} is corrupt (checksum mismatch); delete it and rerun its cache job"
            )
