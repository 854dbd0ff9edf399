"""The shard plan: which entry goes to which cache shard, under which key.

Each kept manifest row becomes one text entry (its final caption) and one
latent entry per training resolution (and per flip, when ``flip`` is on).
Keys hash exactly what determines the cached value:

- latent key = digest(file sha256, transform (bucket ``[F, H, W]``, crop
  position, flip, frame indices), VAE identity (config + weight
  fingerprint), storage dtype, and the sha256 of the item's mask and
  control images when it has them: they are cached in the same entry);
- text key = digest(final caption, tokenizer + text-encoder identity, dtype),
  plus the control image's sha256 for families whose text encoder sees it.

Image entries also record ``original_size`` and ``crop_top_left`` (the source
size and where the crop starts in the resized image: SDXL's size conditioning,
read by the training reader); both follow from what the latent key holds.

So a caption edit changes one text key and no latent key, a VAE change
changes latent keys only, a new resolution adds keys without touching the
others, and two configs sharing a VAE share latent keys (and store entries).

Items keep the shard the previous plan gave them (``cache/plan-state.json``,
outside the checkpoint's folder, which Snakemake replaces with its backup when
a plan job fails);
items new to a plan all go to the smallest shard, and a first plan uses
``int(id) mod shards``. So adding files rebuilds one shard, and removing or
editing one item touches only its own shard. Latent and text specs are separate files
(one per shard each), written only when their content changes: the rule keeps the
folder (``update()``), so an unchanged spec keeps its mtime and its shard stays
up to date however large the spec. ``plan.json``
reports the buckets, and those smaller than a global batch (the reader
fills them by repetition, never drops them). ``empty.json`` is the spec of
the empty caption (caption dropout), cached once.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffpipe.config import CONTROL_ROLES, CacheConfig, DatasetConfig
from diffpipe.data.cache.buckets import choose_bucket, crop_offset, crop_top_left, dataset_ratios
from diffpipe.data.cache.frames import clip_windows
from diffpipe.data.cache.latents import bucket_name
from diffpipe.data.dataset.aux_images import ROLES, problem_reasons
from diffpipe.paths import RunPaths, shard_name
from diffpipe.utils import digest, record_files, stable_json, write_if_changed

SPEC_VERSION = 2
EMPTY_ID = "__empty__"


@dataclass
class PlanResult:
    """What the plan holds and which spec files it wrote or removed."""

    items: int
    shards: list[str]
    buckets: dict[str, int]
    written: list[Path] = field(default_factory=list)
    removed: list[Path] = field(default_factory=list)
    entries: int = 0
    underfilled: dict[str, int] = field(default_factory=dict)
    too_short: list[str] = field(default_factory=list)


def effective_repeats(repeats: int, weight: float) -> int:
    """How often an item is drawn per epoch: its dataset's repeats scaled by its weight.

    Rounded to a whole count (at least 1) so every epoch has the same length,
    which training and exact resume rely on.
    """
    return max(1, round(repeats * weight))


def shard_index(item_id: str, shards: int) -> int:
    """Stable shard of an item: its hex id read as an integer, mod ``shards``."""
    return int(item_id, 16) % shards


def assign_shards(ids: list[str], shards: int, previous: dict[str, int] | None = None) -> dict[str, int]:
    """Shard of every item: sticky across plans, new items together (:func:`diffpipe.data.cache.plan_table.assign`,
    for a list of ids).

    Without a previous assignment (or with another shard count) items go to
    :func:`shard_index`. Otherwise items keep their previous shard, and the
    items new to this plan all go to the shard holding the fewest items (lowest
    index on ties): adding 10 files rebuilds one shard, not up to 10.
    """
    # deferred: polars (start-up time, see make_plan)
    import polars as pl

    from diffpipe.data.cache import plan_table

    column = pl.Series("id", ids, dtype=pl.String)
    return dict(zip(ids, plan_table.assign(column, shards, previous).to_list(), strict=True))


def final_caption(prefix: str, caption: str) -> str:
    """The caption the model sees: ``prefix`` (e.g. a trigger word), a space, the caption."""
    prefix = prefix.strip()
    return f"{prefix} {caption}" if prefix else caption


def augment_caption(caption: str, *, variant: int, seed: int, keep: int = 0, shuffle: bool = False,
                    dropout: float = 0.0) -> str:
    """Caption variant ``variant`` (0: the caption itself): its comma-separated tags after the first ``keep``
    dropped with probability ``dropout`` and shuffled, by a generator seeded from (seed, caption, variant)."""
    if variant == 0:
        return caption
    tags = [tag.strip() for tag in caption.split(",") if tag.strip()]
    kept, rest = tags[:keep], tags[keep:]
    rng = random.Random(digest(["caption-variant", seed, caption, variant]))
    if dropout:
        rest = [tag for tag in rest if rng.random() >= dropout]
    if shuffle:
        rng.shuffle(rest)
    return ", ".join(kept + rest)


def variant_id(item_id: str, variant: int) -> str:
    """The text entry id of a caption variant (variant 0 keeps the item's id)."""
    return item_id if variant == 0 else f"{item_id}~c{variant}"


def transform(
    bucket: list[int],
    *,
    crop: tuple[float, float] = (0.5, 0.5),
    flip: bool = False,
    frames: list[int] | None = None,
) -> dict[str, Any]:
    """Everything that turns a file into the pixels the VAE sees (part of the latent key)."""
    return {
        "bucket": list(bucket),
        "crop": [round(crop[0], 6), round(crop[1], 6)],
        "flip": bool(flip),
        "frames": frames,
    }


def latent_key(
    sha256: str,
    tf: dict[str, Any] | list[int],
    identity: str,
    dtype: str,
    aux: dict[str, str] | None = None,
) -> str:
    """Key of a latent entry (``tf`` a :func:`transform`; a bare bucket means center, no flip).

    ``aux`` maps a role (``mask``, ``control``) to its image's sha256; items
    without aux images keep the key they always had.
    """
    if not isinstance(tf, dict):
        tf = transform(list(tf))
    parts: list[Any] = ["latent", sha256, tf, identity, dtype]
    if aux:
        parts.append(dict(sorted(aux.items())))
    return digest(parts)


def item_aux(row: dict[str, Any]) -> dict[str, dict[str, str]]:
    """A manifest row's usable aux images: role -> ``{"path", "sha256"}``.

    An image flagged missing, corrupt or mismatched is left out even when the
    policy kept its item (``warn``): it then trains unmasked / without control.
    """
    reasons = set(row.get("reasons") or [])
    out = {}
    for role in ROLES:
        sha = row.get(f"{role}_sha256")
        if sha and not reasons & problem_reasons(role):
            out[role] = {"path": row[f"{role}_path"], "sha256": sha}
    return out


def _text_control(aux: dict[str, dict[str, str]]) -> dict[str, str] | list[dict[str, str]] | None:
    """What a text entry carries of its item's control images: the one image, a list of its references
    (``control``, ``control2``, ...: ``datasets[].control_path`` as a list), or None."""
    refs = [aux[role] for role in CONTROL_ROLES if role in aux]
    return None if not refs else refs[0] if len(refs) == 1 else refs


def _control_sha(control: dict[str, str] | list[dict[str, str]] | None) -> str | None:
    if isinstance(control, list):
        return "+".join(c["sha256"] for c in control)
    return control and control["sha256"]


def text_key(caption: str, identity: str, dtype: str, control: str | None = None) -> str:
    """Key of a text entry; ``control`` (the control image's sha256) only for families whose
    text encoder sees the control image (``Family.text_uses_control``)."""
    return digest(["text", caption, identity, dtype] + ([control] if control else []))


def _spec_json(obj: dict[str, Any]) -> str:
    return stable_json(obj) + "\n"


def _entries(
    row: dict[str, Any],
    ds: DatasetConfig,
    *,
    identity: str,
    dtype: str,
    pixel_multiple: int,
    fps: float,
    frame_rule: tuple[int, int],
) -> list[dict[str, Any]]:
    """The latent entries of one manifest row: one per clip window, resolution and flip."""
    ratios = dataset_ratios(ds)
    aux = item_aux(row)
    if ds.control_from_first_frame and "control" not in aux:
        # The first frame is part of the clip (its sha256 is in the key already); the marker
        # still changes the key, so toggling the option re-caches the item.
        aux["control"] = {"first_frame": True}
    if ds.control_from_last_frame and "control" in aux:
        aux["control"] = {**aux["control"], "last_frame": True}  # the clip's last frame follows the control
    aux_shas = {
        role: a.get("sha256", "first_frame") + ("+last_frame" if a.get("last_frame") else "") for role, a in aux.items()
    }
    windows = _windows(row, ds, fps, frame_rule)
    if not windows:
        return []
    out = []
    # Window k > 0 of a clip is its own item ``<id>#w<k>``; window 0 keeps the clip's id.
    for k, frames in enumerate(windows):
        out += _window_entries(
            row,
            ds,
            frames,
            "" if k == 0 else f"#w{k}",
            ratios=ratios,
            aux=aux,
            aux_shas=aux_shas,
            identity=identity,
            dtype=dtype,
            pixel_multiple=pixel_multiple,
        )
    if ds.role != "train" or ds.loss_weight != 1:  # only then: default specs stay as they were
        for e in out:
            e["role"], e["loss_weight"] = ds.role, ds.loss_weight
            if ds.prior_target != "data":
                e["prior_target"] = ds.prior_target
    return out


def _windows(row: dict[str, Any], ds: DatasetConfig, fps: float, frame_rule: tuple[int, int]) -> list[list[int] | None]:
    """The frame indices of each clip window of a row (``[None]`` for an image); empty for a clip shorter than
    every frame bucket."""
    n_src = int(row.get("frames") or 1)
    if n_src > 1:
        step, offset = frame_rule
        return clip_windows(n_src, float(row.get("fps") or fps), fps, ds.frame_buckets, step=step, offset=offset,
                            mode=ds.clip_windows, count=ds.max_windows)
    if row.get("kind") == "video":
        return [[0]]  # a one-frame clip: still decoded as video, never by the image loader
    return [None]


def _window_entries(
    row: dict[str, Any],
    ds: DatasetConfig,
    frames: list[int] | None,
    window: str,
    *,
    ratios: Any,
    aux: dict[str, Any],
    aux_shas: dict[str, str],
    identity: str,
    dtype: str,
    pixel_multiple: int,
) -> list[dict[str, Any]]:
    """One window's latent entries: one per resolution and flip."""
    n = len(frames) if frames else 1
    out = []
    for res in ds.training_resolutions():
        h, w = choose_bucket(row["width"], row["height"], res, pixel_multiple, ratios)
        bucket = [n, h, w]
        crop = (0.5, 0.5)
        if ds.crop == "random":
            crop = crop_offset(f"{row['sha256']}:{bucket_name(bucket)}")
        for flip in (False, True) if ds.flip else (False,):
            tf = transform(bucket, crop=crop, flip=flip, frames=frames)
            suffix = ("" if len(ds.training_resolutions()) == 1 else f"@{res}") + (":flip" if flip else "")
            out.append(
                {
                    "id": row["id"] + window + suffix,
                    "item": row["id"],
                    "path": row["path"],
                    "sha256": row["sha256"],
                    "bucket": bucket,
                    "crop": tf["crop"],
                    "flip": flip,
                    "frames": frames,
                    "key": latent_key(row["sha256"], tf, identity, dtype, aux_shas),
                    "repeats": effective_repeats(ds.repeats, ds.weight),
                    "dataset": ds.name,
                    "split": row.get("split") or "train",
                    **({"aux": aux} if aux else {}),
                    **(_size_conditioning(row, bucket, crop, flip) if frames is None else {}),
                }
            )
    return out


def _size_conditioning(row: dict[str, Any], bucket: list[int], crop: tuple[float, float], flip: bool) -> dict:
    """An image entry's source size and crop offset, ``[h, w]`` / ``[top, left]`` pixels (SDXL's
    micro-conditioning). Pure functions of what the latent key holds, so not part of it."""
    size = (int(row["height"]), int(row["width"]))
    return {"original_size": list(size), "crop_top_left": list(crop_top_left(size, tuple(bucket[1:]), crop, flip))}


def _planned_items(manifest_path: Path, by_name: dict[str, DatasetConfig], fps: float,
                   frame_rule: tuple[int, int]) -> tuple[Any, list[dict[str, Any]], Any]:
    """The manifest's items to plan (a polars table: not skipped by validation, clips long enough for a frame
    bucket), the clips too short, and the manifest's ``max_pixels``.

    Raises:
        ValueError: the manifest names a dataset the config lacks, or leaves no item to train on.
    """
    # deferred: polars (start-up time of the CLI and of Snakemake's DAG, which import this module's callers)
    from diffpipe.data.cache import plan_table

    items, max_pixels = plan_table.read_items(manifest_path)
    if (name := plan_table.unknown_dataset(items, set(by_name))) is not None:
        raise ValueError(f"manifest {manifest_path} lists dataset {name!r}, which is not in the config; rerun "
                         "the validate step")
    kept, skipped = plan_table.kept(items)
    too_short = [row for row in plan_table.clips(kept) if not _windows(row, by_name[row["dataset"]], fps, frame_rule)]
    planned = plan_table.without(kept, [row["id"] for row in too_short])
    n_train = plan_table.count_train(planned)
    if not n_train:
        raise ValueError(
            f"the plan has no item to train on: {items.height} in the manifest {manifest_path}, {skipped} skipped "
            f"by validation, {len(too_short)} shorter than every frame bucket, {planned.height - n_train} held out "
            "for eval; see the validation report"
        )
    return planned, too_short, max_pixels


def make_plan(
    manifest_path: str | Path,
    datasets: list[DatasetConfig],
    cache_cfg: CacheConfig,
    *,
    latent_identity: str,
    text_identity: str,
    pixel_multiple: int,
    paths: RunPaths,
    global_batch: int = 1,
    fps: float = 24.0,
    frame_rule: tuple[int, int] = (4, 1),
    text_control: bool = False,
) -> PlanResult:
    """Write one latent spec and one text spec per shard, the empty-caption spec and the summary.

    ``global_batch`` (micro-batch x accumulation x processes) only feeds the
    report of buckets smaller than a batch. ``fps`` and ``frame_rule``
    (``step, offset``: counts ``step*k + offset``) are the model's, for video.
    ``text_control``: the text encoder sees the control image, so a text entry
    carries the item's control image and its key the image's sha256.

    The specs carry the manifest's ``max_pixels``, so the cache jobs refuse a
    file whose header grew past the validated limit since.

    The items are a polars table (:mod:`diffpipe.data.cache.plan_table`); one shard's items at a time
    become dicts, for its entries.

    Raises:
        ValueError: the manifest is missing, names a dataset the config lacks,
            or leaves no item to train on (with the counts).
    """
    # deferred: polars (start-up time of the CLI and of Snakemake's DAG, which import this module's callers)
    from diffpipe.data.cache import plan_table

    manifest_path = Path(manifest_path)
    by_name = {d.name: d for d in datasets}
    planned, too_short, max_pixels = _planned_items(manifest_path, by_name, fps, frame_rule)
    shards = plan_table.assign(planned["id"], cache_cfg.shards, _read_state(paths.plan_state, cache_cfg.shards))
    names = [shard_name(i) for i in range(cache_cfg.shards)]
    result = PlanResult(items=planned.height, shards=names, buckets={}, too_short=[r["path"] for r in too_short])
    common: dict[str, Any] = {"version": SPEC_VERSION, "dtype": cache_cfg.dtype}
    if max_pixels:  # the decoders' limit (manifests older than it: the decoders' default)
        common["max_pixels"] = int(max_pixels)
    build = _EntryBuilder(by_name, latent_identity=latent_identity, text_identity=text_identity,
                          dtype=cache_cfg.dtype, pixel_multiple=pixel_multiple, fps=fps, frame_rule=frame_rule,
                          text_control=text_control)
    tally = _Tally()
    for k, rows in plan_table.shard_slices(planned.with_columns(shards), cache_cfg.shards):
        latents, texts = build.shard(rows)
        tally.add(names[k], latents)
        _write_shard_specs(paths, result, names[k], latents, texts, common, latent_identity, text_identity)
    _write_empty_spec(paths, result, names, common, text_identity, cache_cfg.dtype)
    result.entries = tally.entries
    result.buckets = dict(sorted(tally.buckets.items()))
    result.underfilled = {b: n for b, n in sorted(tally.samples.items()) if n < global_batch}
    _write_summary(paths, result, tally.shards, global_batch, cache_cfg.dtype)
    _record_plan(paths, names, plan_table.state_json(planned["id"], shards, cache_cfg.shards))
    return result


def _record_plan(paths: RunPaths, names: list[str], state: str) -> None:
    """The list of the plan folder's files and, outside it, the shard assignment the next plan keeps
    (``state``: :func:`diffpipe.data.cache.plan_table.state_json`)."""
    # Snakemake replaces plan/ with its backup when a plan job fails: `diffpipe run` first checks it holds
    # only these.
    planned_files = [paths.plan_summary, paths.empty_spec, *(f(n) for n in names for f in (paths.latent_spec,
                                                                                           paths.text_spec))]
    record_files(paths.plan_dir, [p.relative_to(paths.plan_dir).as_posix() for p in planned_files])
    # Outside the plan folder: a failed plan job's folder is restored from Snakemake's backup.
    write_if_changed(paths.plan_state, state + "\n")


@dataclass
class _Tally:
    """What the summary reports: entries, buckets and what one epoch draws per bucket, in all and per shard."""

    entries: int = 0
    buckets: Counter[str] = field(default_factory=Counter)
    samples: Counter[str] = field(default_factory=Counter)  # entries x repeats: what one epoch draws per bucket
    shards: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add(self, name: str, latents: list[dict[str, Any]]) -> None:
        """Count one shard's latent entries."""
        self.entries += len(latents)
        for e in latents:
            self.buckets[bucket_name(e["bucket"])] += 1
            self.samples[bucket_name(e["bucket"])] += e["repeats"]
        self.shards[name] = {
            "items": len({x.get("item", x["id"]) for x in latents}),
            "entries": len(latents),
            "buckets": dict(sorted(Counter(bucket_name(x["bucket"]) for x in latents).items())),
        }


@dataclass
class _EntryBuilder:
    """Builds the latent entries (bucket, crop, frames, key) and text entries of kept manifest rows."""

    by_name: dict[str, DatasetConfig]
    latent_identity: str
    text_identity: str
    dtype: str
    pixel_multiple: int
    fps: float
    frame_rule: tuple[int, int]
    text_control: bool

    def shard(self, rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """One shard's latent and text entries, its rows in id order."""
        latents: list[dict[str, Any]] = []
        texts: list[dict[str, Any]] = []
        for row in rows:
            ds = self.by_name[row["dataset"]]
            entries = _entries(row, ds, identity=self.latent_identity, dtype=self.dtype,
                               pixel_multiple=self.pixel_multiple, fps=self.fps, frame_rule=self.frame_rule)
            if ds.caption_variants > 1:
                for e in entries:
                    e["caption_variants"] = ds.caption_variants
            latents += entries
            texts += self.texts(row, ds)
        return latents, texts

    def texts(self, row: dict[str, Any], ds: DatasetConfig) -> list[dict[str, Any]]:
        """A row's text entries: one per caption variant."""
        control = _text_control(item_aux(row)) if self.text_control else None
        out = []
        for k in range(ds.caption_variants):
            caption = final_caption(ds.caption_prefix, augment_caption(
                row["caption"], variant=k, seed=ds.caption_seed, keep=ds.keep_tags, shuffle=ds.shuffle_tags,
                dropout=ds.tag_dropout))
            out.append({
                "id": variant_id(row["id"], k),
                "caption": caption,
                "key": text_key(caption, self.text_identity, self.dtype, _control_sha(control)),
                **({"control": control} if control else {}),
            })
        return out


def _write_shard_specs(paths: RunPaths, result: PlanResult, name: str, latents: list[dict[str, Any]],
                       texts: list[dict[str, Any]], common: dict[str, Any], latent_identity: str,
                       text_identity: str) -> None:
    """A shard's latent and text spec, each written only when changed (recorded in ``result``)."""
    lspec = {**common, "kind": "latents", "shard": name, "identity": latent_identity, "items": latents}
    tspec = {**common, "kind": "text", "shard": name, "identity": text_identity, "items": texts}
    for path, spec in ((paths.latent_spec(name), lspec), (paths.text_spec(name), tspec)):
        if write_if_changed(path, _spec_json(spec)):
            result.written.append(path)


def _write_empty_spec(paths: RunPaths, result: PlanResult, names: list[str], common: dict[str, Any],
                      text_identity: str, dtype: str) -> None:
    """The empty-caption spec, written only when changed; specs of shards no longer planned removed (all
    recorded in ``result``)."""
    empty = {
        **common,
        "kind": "text",
        "shard": "empty",
        "identity": text_identity,
        "items": [{"id": EMPTY_ID, "caption": "", "key": text_key("", text_identity, dtype)}],
    }
    if write_if_changed(paths.empty_spec, _spec_json(empty)):
        result.written.append(paths.empty_spec)
    for kind in ("latents", "text"):
        for old in sorted((paths.plan_dir / kind).glob("*.json")):
            if old.stem not in names:
                old.unlink()
                result.removed.append(old)


def _write_summary(paths: RunPaths, result: PlanResult, shards: dict[str, dict[str, Any]], global_batch: int,
                   dtype: str) -> None:
    """``plan.json``: items, entries and buckets in all and per shard, underfilled buckets, too-short clips."""
    summary = {
        "items": result.items,
        "entries": result.entries,
        "buckets": result.buckets,
        "global_batch": global_batch,
        # Filled by repeating their own items when training, never dropped.
        "underfilled_buckets": result.underfilled,
        "too_short": result.too_short,
        "shards": {name: shards[name] for name in result.shards},
        "dtype": dtype,
    }
    if write_if_changed(paths.plan_summary, _spec_json(summary)):
        result.written.append(paths.plan_summary)


def _read_state(path: Path, shards: int) -> Any:
    """The previous plan's item -> shard table (None when absent, damaged or for another shard count)."""
    # deferred: polars (start-up time, see make_plan)
    from diffpipe.data.cache import plan_table

    try:
        text = Path(path).read_text()
    except (OSError, ValueError):
        return None
    return plan_table.read_state(text, shards)


def read_spec(path: str | Path) -> dict[str, Any]:
    """Load a spec file, with an error naming it when it is missing or damaged."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"spec {path} not found; run the plan step first") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"spec {path} is not valid JSON ({err}); rerun the plan step") from None
