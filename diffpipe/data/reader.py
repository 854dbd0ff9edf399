"""Training-side view of the caches: every planned item, verified, in memory.

``CachedDataset.from_run`` reads the plan's specs, opens each shard once,
checks its checksum, and checks that every planned item is stored under its
expected key with a consistent shape, before a single training step runs.
Arrays are read whole (one read per bucket per shard) and concatenated; items
then index into them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from diffpipe.data.latents import LatentShard, bucket_name, storage_to_tensor
from diffpipe.data.plan import read_spec
from diffpipe.data.text import TextShard
from diffpipe.paths import RunPaths


@dataclass(frozen=True)
class _Item:
    id: str
    path: str
    bucket: str
    row: int  # row in the bucket's latent tensor
    text_row: int  # row in the text tensors
    repeats: int


def _concat(parts: list[np.ndarray], dtype: str) -> torch.Tensor:
    return storage_to_tensor(np.concatenate(parts) if len(parts) > 1 else parts[0], dtype)


class CachedDataset:
    """Cached latents and text embeddings of a run, joined by item id."""

    def __init__(
        self,
        items: list[_Item],
        latents: dict[str, torch.Tensor],
        text: dict[str, torch.Tensor],
        empty_text: dict[str, torch.Tensor] | None,
        shards: list[str],
    ):
        self.items = items
        self._latents = latents
        self._text = text
        self.empty_text = empty_text
        self.shards = shards
        self._by_bucket: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            self._by_bucket.setdefault(item.bucket, []).append(i)

    def __len__(self) -> int:
        return len(self.items)

    @classmethod
    def from_run(cls, paths: RunPaths, split: str | None = "train") -> CachedDataset:
        """Open and verify every shard the plan names; raises ValueError naming what is wrong.

        ``split`` keeps the entries of that split (``"train"``, ``"eval"``); None keeps all.
        Every planned entry is verified either way.
        """
        shards = paths.shard_names("latents")
        if not shards:
            raise ValueError(f"no latent specs under {paths.plan_dir}; run the plan step first")
        if paths.shard_names("text") != shards:
            raise ValueError(
                f"latent and text specs under {paths.plan_dir} name different shards; rerun plan"
            )
        records: list[
            tuple[str, str, str, int, int, int]
        ] = []  # id, path, bucket, lat row, text row, reps
        lat_parts: dict[str, list[np.ndarray]] = {}
        text_parts: dict[str, list[np.ndarray]] = {}
        lat_rows: dict[str, int] = {}
        text_rows = 0
        dtypes: set[str] = set()
        geometry: dict[str, tuple[int, ...]] = {}
        text_shapes: dict[str, tuple[int, ...]] | None = None
        for s in shards:
            lspec, tspec = read_spec(paths.latent_spec(s)), read_spec(paths.text_spec(s))
            lshard = LatentShard(paths.latent_shard(s))
            arrays = lshard.load()  # raises on a checksum mismatch
            tshard = TextShard(paths.text_shard(s))
            tarrays = tshard.load()  # raises on a checksum mismatch
            dtypes |= {lshard.dtype, tshard.dtype}
            if tspec["items"] and text_shapes is not None and tshard.shapes != text_shapes:
                raise ValueError(
                    f"text shard {tshard.path} has shapes {tshard.shapes}, others {text_shapes}"
                )
            if tspec["items"]:
                text_shapes = tshard.shapes
            lat_index = {
                item_id: (name, r, key)
                for name, meta in lshard.meta.items()
                for r, (item_id, key) in enumerate(zip(meta["ids"], meta["keys"], strict=True))
            }
            text_index = {
                item_id: (r, key)
                for r, (item_id, key) in enumerate(zip(tshard.ids, tshard.keys, strict=True))
            }
            text_by_id = {t["id"]: t for t in tspec["items"]}
            for item in lspec["items"]:
                name = bucket_name(item["bucket"])
                found = lat_index.get(item["id"])
                if found is None or found[0] != name or found[2] != item["key"]:
                    raise ValueError(
                        f"latent shard {lshard.path} has no entry for {item['path']} (key {item['key']}, "
                        f"bucket {name}); rerun its cache job"
                    )
                source = item.get("item", item["id"])  # several latent entries share one caption
                titem = text_by_id.get(source)
                if titem is None:
                    raise ValueError(
                        f"text spec {paths.text_spec(s)} lacks {item['path']}; rerun the plan step"
                    )
                tfound = text_index.get(source)
                if tfound is None or tfound[1] != titem["key"]:
                    raise ValueError(
                        f"text shard {tshard.path} has no entry for {item['path']} (key {titem['key']}); "
                        "rerun its cache job"
                    )
                geometry.setdefault(
                    name, _check_geometry(lshard, name, arrays[name].shape, item["bucket"])
                )
                if split is not None and item.get("split", "train") != split:
                    continue
                records.append(
                    (
                        item["id"],
                        item["path"],
                        name,
                        lat_rows.get(name, 0) + found[1],
                        text_rows + tfound[0],
                        int(item.get("repeats", 1)),
                    )
                )
            for name, arr in arrays.items():
                lat_parts.setdefault(name, []).append(arr)
                lat_rows[name] = lat_rows.get(name, 0) + len(arr)
            for name, arr in tarrays.items():
                text_parts.setdefault(name, []).append(arr)
            text_rows += len(tshard)
        _check_channels(geometry, paths)
        if len(dtypes) > 1:
            raise ValueError(
                f"caches under {paths.root} mix dtypes {sorted(dtypes)}; rerun the cache step"
            )
        dtype = dtypes.pop()
        latents = {name: _concat(parts, dtype) for name, parts in lat_parts.items()}
        text = {name: _concat(parts, dtype) for name, parts in text_parts.items()}
        empty = None
        if paths.text_empty.is_file():
            eshard = TextShard(paths.text_empty)
            if paths.empty_spec.is_file():
                want = read_spec(paths.empty_spec)["items"][0]["key"]
                if eshard.keys != [want]:
                    raise ValueError(
                        f"text shard {eshard.path} holds another empty-caption key than the plan's ({want}); "
                        "rerun `diffpipe cache empty`"
                    )
            empty = {name: t.float() for name, t in eshard.tensors().items()}
            if text_shapes is not None and eshard.shapes != text_shapes:
                raise ValueError(
                    f"text shard {eshard.path} has shapes {eshard.shapes}, others {text_shapes}"
                )
        records.sort()
        items = [_Item(*r) for r in records]
        return cls(items, latents, text, empty, shards)

    # -- batching -----------------------------------------------------------------
    def epoch_batches(self, epoch: int, batch_size: int, seed: int) -> list[list[int]]:
        """Batches of item indices for one epoch: one bucket per batch, every batch full.

        Each item appears ``repeats`` times; a bucket's last partial batch (or a
        bucket smaller than the batch) is filled by repeating its own items,
        never dropped. The order depends only on (seed, epoch).
        """
        rng = random.Random(f"{seed}:{epoch}")
        batches: list[list[int]] = []
        for name in sorted(self._by_bucket):
            seq = [i for i in self._by_bucket[name] for _ in range(self.items[i].repeats)]
            rng.shuffle(seq)
            seq += [seq[j % len(seq)] for j in range((-len(seq)) % batch_size)]
            batches += [seq[k : k + batch_size] for k in range(0, len(seq), batch_size)]
        rng.shuffle(batches)
        return batches

    def num_batches(self, batch_size: int) -> int:
        """Batches per epoch (the same for every epoch and seed)."""
        return sum(
            math.ceil(sum(self.items[i].repeats for i in idx) / batch_size)
            for idx in self._by_bucket.values()
        )

    def collate(self, indices: Sequence[int]) -> dict[str, Any]:
        """Stack items of one bucket: latents ``[B,C,F,h,w]``, text ``{name: [B,...]}`` (float32)."""
        items = [self.items[i] for i in indices]
        buckets = {it.bucket for it in items}
        if len(buckets) != 1:
            raise ValueError(f"a batch must come from one bucket, got {sorted(buckets)}")
        rows = torch.tensor([it.row for it in items], dtype=torch.long)
        trows = torch.tensor([it.text_row for it in items], dtype=torch.long)
        return {
            "latents": self._latents[buckets.pop()][rows].float(),
            "text": {name: t[trows].float() for name, t in self._text.items()},
            "ids": [it.id for it in items],
        }

    def summary(self) -> dict[str, Any]:
        """Item count, items per bucket, latent shape per bucket, text shapes."""
        return {
            "items": len(self),
            "shards": len(self.shards),
            "buckets": {name: len(idx) for name, idx in sorted(self._by_bucket.items())},
            "latent_shapes": {name: list(t.shape[1:]) for name, t in sorted(self._latents.items())},
            "text_shapes": {name: list(t.shape[1:]) for name, t in sorted(self._text.items())},
            "empty_text": self.empty_text is not None,
        }


def _check_geometry(
    shard: LatentShard, name: str, shape: tuple[int, ...], bucket: list[int]
) -> tuple[int, ...]:
    """``(C, spatial factor)`` of an array, after checking it matches its pixel bucket."""
    f, h, w = bucket
    if (
        len(shape) != 5
        # Video VAEs compress time (F frames -> (F-1)/4+1): a clip's latent has 1..F frames.
        or not (1 <= shape[2] <= f)
        or h % shape[3]
        or w % shape[4]
        or h // shape[3] != w // shape[4]
    ):
        raise ValueError(
            f"latent shard {shard.path}: array {name} has shape {list(shape)}, which does not fit "
            f"pixel bucket {bucket}; rerun its cache job"
        )
    return (shape[1], h // shape[3])


def _check_channels(geometry: dict[str, tuple[int, ...]], paths: RunPaths) -> None:
    if len(set(geometry.values())) > 1:
        raise ValueError(
            f"latent caches under {paths.root} disagree on (channels, downscale): {geometry}; "
            "rerun the cache step"
        )
