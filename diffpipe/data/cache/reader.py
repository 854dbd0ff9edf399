"""Training-side view of the caches: every planned item, verified, in memory.

``CachedDataset.from_run`` reads the plan's specs, opens each shard once,
checks its checksum, and checks that every planned item is stored under its
expected key with a consistent shape, before a single training step runs.
Arrays are read whole (one read per bucket per shard) and concatenated; items
then index into them. Loss masks and control latents, where items have them,
are joined the same way (rows aligned with the latents) and come back in the
batch as ``mask`` and ``control_latents``.
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from diffpipe.data.cache.latents import AUX_FILL, LatentShard, aux_array, bucket_name, storage_to_tensor, widened
from diffpipe.data.cache.plan import read_spec, variant_id
from diffpipe.data.cache.text import TextShard
from diffpipe.paths import RunPaths


@dataclass(frozen=True)
class _Item:
    id: str
    path: str
    bucket: str
    row: int  # row in the bucket's latent tensor
    text_row: int  # row in the text tensors
    repeats: int
    #: Source ``(h, w)`` and crop ``(top, left)`` in pixels (images planned with them; else None).
    sizes: tuple[int, int, int, int] | None = None
    key: str = ""  # the plan's latent cache key (image content and transform)
    text_key: str = ""  # the plan's text cache key (caption)
    #: Text rows of the caption variants 1.. (datasets[].caption_variants); variant 0 is ``text_row``.
    text_variants: tuple[int, ...] = ()
    loss_weight: float = 1.0  # datasets[].loss_weight
    regularization: bool = False  # datasets[].role: regularization
    base_target: bool = False  # datasets[].prior_target: base


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
        aux: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] | None = None,
    ):
        self.items = items
        self._latents = latents
        #: role -> bucket -> (values [N, ...], has [N] bool), rows aligned with the latents.
        self._aux = aux or {}
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
            raise ValueError(f"latent and text specs under {paths.plan_dir} name different shards; rerun plan")
        loader = _ShardLoader(paths, split)
        for s in shards:
            loader.add(s)
        latents, aux, text = loader.joined()
        empty = _empty_text(paths, loader.text_shapes)
        loader.records.sort()
        return cls([_Item(*r) for r in loader.records], latents, text, empty, shards, aux)

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
        return sum(math.ceil(sum(self.items[i].repeats for i in idx) / batch_size) for idx in self._by_bucket.values())

    def collate(self, indices: Sequence[int], epoch: int | None = None) -> dict[str, Any]:
        """Stack items of one bucket: latents ``[B,C,F,h,w]``, text ``{name: [B,...]}`` (float32; token ids int64).

        ``epoch``: training reads each item's caption variant of that epoch (datasets[].caption_variants; a
        fixed function of the item and the epoch); None (evaluation) reads variant 0, the caption itself.

        ``mask``: ``[B,1,F,h,w]`` loss weights in [0, 1] when an item of the batch
        has a mask (ones for the others: they train unmasked), else None.
        ``control_latents``: ``[B,C,F_c,h,w]`` when every item has a control
        image, else None (``control_missing`` lists the ids without one);
        ``control_embeds``: their image-encoder embeddings ``[B, ...]`` when the
        family cached them, else None.
        ``sizes``: ``{"original_size", "crop_top_left"}`` ``[B, 2]`` int pixels
        when every item's plan recorded them (images), else None.
        """
        items = [self.items[i] for i in indices]
        buckets = {it.bucket for it in items}
        if len(buckets) != 1:
            raise ValueError(f"a batch must come from one bucket, got {sorted(buckets)}")
        bucket = buckets.pop()
        rows = torch.tensor([it.row for it in items], dtype=torch.long)
        trows = torch.tensor([_text_row(it, epoch) for it in items], dtype=torch.long)
        batch = {
            "latents": self._latents[bucket][rows].float(),
            "text": {name: widened(t[trows]) for name, t in self._text.items()},
            "ids": [it.id for it in items],
            "mask": None,
            "control_latents": None,
            "control_missing": [],
            "control_embeds": None,
            "sizes": None,
            # Per-item loss weights and which items are regularisation (None: every weight 1, no reg item).
            "loss_weights": None,
            "regularization": None,
            # Which items train towards the base model's prediction (None: none in this batch).
            "base_target": None,
        }
        if self.has_loss_weights:  # every batch then, so each step logs both roles' losses
            batch.update(_loss_weights(items))
        if all(it.sizes is not None for it in items):
            sizes = torch.tensor([it.sizes for it in items], dtype=torch.long)
            batch["sizes"] = {"original_size": sizes[:, :2], "crop_top_left": sizes[:, 2:]}
        self._add_aux(batch, bucket, rows, items)
        return batch

    def _add_aux(self, batch: dict[str, Any], bucket: str, rows: torch.Tensor, items: list[_Item]) -> None:
        """The batch's ``mask``, ``control_latents`` and ``control_embeds`` (or ``control_missing``): see
        :meth:`collate`."""
        if bucket in self._aux.get("mask", {}):
            values, has = self._aux["mask"][bucket]
            if bool(has[rows].any()):
                batch["mask"] = values[rows].float()
        if bucket not in self._aux.get("control", {}):
            batch["control_missing"] = [it.id for it in items]
            return
        values, has = self._aux["control"][bucket]
        if not bool(has[rows].all()):
            batch["control_missing"] = [it.id for it, h in zip(items, has[rows], strict=True) if not h]
            return
        batch["control_latents"] = values[rows].float()
        if bucket in self._aux.get("control_embeds", {}):
            embeds, has_embeds = self._aux["control_embeds"][bucket]
            if bool(has_embeds[rows].all()):
                batch["control_embeds"] = embeds[rows].float()

    @cached_property
    def has_loss_weights(self) -> bool:
        """Whether any item has a loss weight other than 1 or is a regularisation item."""
        return any(it.loss_weight != 1 or it.regularization for it in self.items)

    @property
    def has_masks(self) -> bool:
        """Whether any item has a loss mask."""
        return any(bool(has.any()) for _, has in self._aux.get("mask", {}).values())

    @property
    def has_controls(self) -> bool:
        """Whether any item has control latents."""
        return any(bool(has.any()) for _, has in self._aux.get("control", {}).values())

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


def _loss_weights(items: list[_Item]) -> dict[str, torch.Tensor | None]:
    """A batch's ``loss_weights`` and ``regularization`` flags, and ``base_target`` (None: no item in it trains
    towards the base model's prediction)."""
    out: dict[str, torch.Tensor | None] = {
        "loss_weights": torch.tensor([it.loss_weight for it in items], dtype=torch.float32),
        "regularization": torch.tensor([it.regularization for it in items], dtype=torch.bool),
    }
    if any(it.base_target for it in items):
        out["base_target"] = torch.tensor([it.base_target for it in items], dtype=torch.bool)
    return out


def _sizes(item: dict[str, Any]) -> tuple[int, int, int, int] | None:
    """A spec entry's ``original_size + crop_top_left`` (None for clips and older plans)."""
    if "original_size" not in item or "crop_top_left" not in item:
        return None
    return (*map(int, item["original_size"]), *map(int, item["crop_top_left"]))


def _join_aux(
    parts: list[tuple[np.ndarray | None, list[bool]]], fill: float, dtype: str
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One bucket's aux rows over every shard, blanks where a shard has none; None when no shard has any."""
    shape = next((arr.shape[1:] for arr, _ in parts if arr is not None), None)
    if shape is None:
        return None
    # Kept in the storage dtype like the latents (bf16 halves the memory); collate widens.
    tdtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    tensors = [
        storage_to_tensor(arr, dtype) if arr is not None else torch.full((len(has), *shape), fill, dtype=tdtype)
        for arr, has in parts
    ]
    has = torch.tensor([h for _, hs in parts for h in hs], dtype=torch.bool)
    return torch.cat(tensors), has


def _check_geometry(shard: LatentShard, name: str, shape: tuple[int, ...], bucket: list[int]) -> tuple[int, ...]:
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
            f"latent caches under {paths.root} disagree on (channels, downscale): {geometry}; rerun the cache step"
        )


class _ShardLoader:
    """Reads the shards of a run one by one (:meth:`add`), checking each planned entry against them, and
    joins their arrays per bucket (:meth:`joined`)."""

    def __init__(self, paths: RunPaths, split: str | None):
        self.paths, self.split = paths, split
        self.records: list[tuple] = []  # id, path, bucket, lat row, text row, reps, sizes, key, text key
        self.lat_parts: dict[str, list[np.ndarray]] = {}
        # role -> bucket -> one (values or None, has) per shard part of that bucket
        self.aux_parts: dict[str, dict[str, list[tuple[np.ndarray | None, list[bool]]]]] = {r: {} for r in AUX_FILL}
        self.text_parts: dict[str, list[np.ndarray]] = {}
        self.lat_rows: dict[str, int] = {}
        self.text_rows = 0
        self.dtypes: set[str] = set()
        self.geometry: dict[str, tuple[int, ...]] = {}
        self.text_shapes: dict[str, tuple[int, ...]] | None = None

    def add(self, s: str) -> None:
        """One shard: load both files (checksums verified), match its planned entries, keep its arrays."""
        paths = self.paths
        lspec, tspec = read_spec(paths.latent_spec(s)), read_spec(paths.text_spec(s))
        lshard = LatentShard(paths.latent_shard(s))
        arrays = lshard.load()  # raises on a checksum mismatch
        tshard = TextShard(paths.text_shard(s))
        tarrays = tshard.load()  # raises on a checksum mismatch
        self.dtypes |= {lshard.dtype, tshard.dtype}
        if tspec["items"] and self.text_shapes is not None and tshard.shapes != self.text_shapes:
            raise ValueError(f"text shard {tshard.path} has shapes {tshard.shapes}, others {self.text_shapes}")
        if tspec["items"]:
            self.text_shapes = tshard.shapes
        self._match(s, lspec, tspec, lshard, tshard, arrays)
        for name in lshard.names:
            arr = arrays[name]
            self.lat_parts.setdefault(name, []).append(arr)
            self.lat_rows[name] = self.lat_rows.get(name, 0) + len(arr)
            for role in AUX_FILL:
                meta = lshard.aux_meta.get(aux_array(role, name))
                part = (None, [False] * len(arr))
                if meta is not None:
                    part = (arrays[aux_array(role, name)], list(meta["has"]))
                self.aux_parts[role].setdefault(name, []).append(part)
        for name, arr in tarrays.items():
            self.text_parts.setdefault(name, []).append(arr)
        self.text_rows += len(tshard)

    def _match(self, s: str, lspec: dict, tspec: dict, lshard: LatentShard, tshard: TextShard,
               arrays: dict[str, np.ndarray]) -> None:
        """A record per planned entry of this shard's split, each checked to be in both shards under its key."""
        lat_index = {
            item_id: (name, r, key)
            for name, meta in lshard.meta.items()
            for r, (item_id, key) in enumerate(zip(meta["ids"], meta["keys"], strict=True))
        }
        text_index = {item_id: (r, key) for r, (item_id, key) in enumerate(zip(tshard.ids, tshard.keys, strict=True))}
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
                raise ValueError(f"text spec {self.paths.text_spec(s)} lacks {item['path']}; rerun the plan step")
            variant_rows = []
            for k in range(int(item.get("caption_variants", 1))):
                vid = variant_id(source, k)
                vitem, tfound = text_by_id.get(vid), text_index.get(vid)
                if vitem is None:
                    raise ValueError(f"text spec {self.paths.text_spec(s)} lacks caption variant {k} of "
                                     f"{item['path']}; rerun the plan step")
                if tfound is None or tfound[1] != vitem["key"]:
                    raise ValueError(
                        f"text shard {tshard.path} has no entry for {item['path']} (key {vitem['key']}); "
                        "rerun its cache job"
                    )
                variant_rows.append(self.text_rows + tfound[0])
            self.geometry.setdefault(name, _check_geometry(lshard, name, arrays[name].shape, item["bucket"]))
            if self.split is not None and item.get("split", "train") != self.split:
                continue
            self.records.append((
                item["id"], item["path"], name, self.lat_rows.get(name, 0) + found[1], variant_rows[0],
                int(item.get("repeats", 1)), _sizes(item), item["key"], titem["key"], tuple(variant_rows[1:]),
                float(item.get("loss_weight", 1.0)), item.get("role") == "regularization",
                item.get("prior_target") == "base",
            ))

    def joined(self) -> tuple[dict, dict, dict]:
        """``(latents, aux, text)``: every shard's arrays joined per bucket (text per name), as tensors."""
        _check_channels(self.geometry, self.paths)
        if len(self.dtypes) > 1:
            raise ValueError(f"caches under {self.paths.root} mix dtypes {sorted(self.dtypes)}; rerun the cache step")
        dtype = next(iter(self.dtypes))
        latents = {name: _concat(parts, dtype) for name, parts in self.lat_parts.items()}
        aux = {
            role: {
                name: joined
                for name, parts in by_bucket.items()
                if (joined := _join_aux(parts, AUX_FILL[role], dtype)) is not None
            }
            for role, by_bucket in self.aux_parts.items()
        }
        text = {name: _concat(parts, dtype) for name, parts in self.text_parts.items()}
        return latents, aux, text


def _empty_text(paths: RunPaths, text_shapes: dict[str, tuple[int, ...]] | None) -> dict[str, torch.Tensor] | None:
    """The empty-caption embedding (caption dropout), checked against the plan's key and the text shapes;
    None when it was not cached."""
    if not paths.text_empty.is_file():
        return None
    eshard = TextShard(paths.text_empty)
    if paths.empty_spec.is_file():
        want = read_spec(paths.empty_spec)["items"][0]["key"]
        if eshard.keys != [want]:
            raise ValueError(
                f"text shard {eshard.path} holds another empty-caption key than the plan's ({want}); "
                "rerun `diffpipe cache empty`"
            )
    if text_shapes is not None and eshard.shapes != text_shapes:
        raise ValueError(f"text shard {eshard.path} has shapes {eshard.shapes}, others {text_shapes}")
    return {name: widened(t) for name, t in eshard.tensors().items()}


def _text_row(item: _Item, epoch: int | None) -> int:
    """The text row of ``item``'s caption variant for ``epoch`` (variant 0 without variants or an epoch)."""
    if not item.text_variants or epoch is None:
        return item.text_row
    rows = (item.text_row, *item.text_variants)
    return rows[zlib.crc32(f"{item.id}:{epoch}".encode()) % len(rows)]
