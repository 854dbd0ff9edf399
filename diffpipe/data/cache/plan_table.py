"""The shard plan's item table in polars: the manifest's kept items, their shard, and each shard's slice.

The plan reads the manifest's columns into one table, leaves out what validation skipped, and gives
every item its shard with a join on the item id against the previous plan's assignment
(:func:`assign`). Only one shard's items at a time become Python dicts, to build that shard's latent and
text entries (:func:`diffpipe.data.cache.plan.make_plan`), so the plan's memory per item is its columns.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow.parquet as pq

from diffpipe.data.dataset.aux_images import ROLES

#: Columns every manifest has, and those newer manifests add (older ones' missing columns are left out).
_COLUMNS = ["id", "dataset", "path", "sha256", "width", "height", "frames", "caption", "status"]
_NEWER = ["fps", "split", "kind", "reasons", *(f"{role}_{col}" for role in ROLES for col in ("path", "sha256"))]


def read_items(manifest_path: Path) -> tuple[pl.DataFrame, bytes | None]:
    """The manifest's rows (the columns the plan reads), sorted by id, and its ``max_pixels``; a clear error
    when validation has not run."""
    if not manifest_path.is_file():
        raise ValueError(f"manifest {manifest_path} not found; run the validate step first")
    schema = pq.read_schema(manifest_path)
    cols = _COLUMNS + [c for c in _NEWER if c in set(schema.names)]
    # glob=False: a run folder may hold [ ] * ? in its name; it is a path, never a pattern. One copy (Arrow's: two).
    items = pl.read_parquet(manifest_path, columns=cols, use_pyarrow=False, glob=False)
    if not items["id"].is_sorted():  # validation writes it sorted; sorting again would copy every column
        items = items.sort("id")
    return items, (schema.metadata or {}).get(b"max_pixels")


def unknown_dataset(items: pl.DataFrame, names: set[str]) -> str | None:
    """The dataset of the first kept row (by id) that the config lacks, or None."""
    odd = items.filter((pl.col("status") != "skipped") & ~pl.col("dataset").is_in(sorted(names)))
    return odd["dataset"][0] if odd.height else None


def assign(ids: pl.Series, shards: int, previous: dict[str, int] | pl.DataFrame | None) -> pl.Series:
    """Shard of every item (``ids``, in order): sticky across plans, new items together.

    Without a previous assignment (or with another shard count) items go to their hex id read as an
    integer, mod ``shards``. Otherwise items keep their previous shard (a join on the id), and the items
    new to this plan all go to the shard holding the fewest items (lowest index on ties): adding 10 files
    rebuilds one shard, not up to 10. ``previous``: id -> shard, as a dict or an ``id``/``shard`` table
    (:func:`read_state`).
    """
    ids = ids.rename("id")
    if isinstance(previous, dict):
        previous = pl.DataFrame({"id": list(previous), "shard": list(previous.values())},
                                schema={"id": pl.String, "shard": pl.Int64})
    if previous is None or not previous.height or not previous["shard"].is_between(0, shards - 1).all():
        return _by_id(ids, shards)
    kept = ids.to_frame().join(previous, on="id", how="left", maintain_order="left")["shard"]
    if kept.null_count():
        sizes = kept.drop_nulls().value_counts().rows()
        counts = [0] * shards
        for shard, n in sizes:
            counts[shard] = n
        target = min(range(shards), key=lambda k: (counts[k], k))
        kept = kept.fill_null(target)
    return kept.alias("shard")


def read_state(text: str, shards: int) -> pl.DataFrame | None:
    """The previous plan's ``id``/``shard`` table from its state file's text (:func:`state_json`); None when
    damaged, empty or for another shard count.

    The text :func:`state_json` writes for hex ids is split in polars: ``json.loads`` made a Python dict of
    every item (~280 bytes each at 200,000 items). Any other text goes through ``json``.
    """
    head, tail = '{"assignment":{', '},"shards":' + str(shards) + "}"
    body = text.rstrip("\n")
    if body.startswith(head) and (end := _STATE_END.search(body)) and end[0] != tail:
        return None  # another shard count: nothing to parse
    if body.startswith(head) and body.endswith(tail) and _HEX_STATE.fullmatch(body[len(head):-len(tail)]):
        pairs = pl.Series([body[len(head):-len(tail)]]).str.split(",").explode().str.split_exact(":", 1)
        table = pairs.struct.unnest().select(
            pl.col("field_0").str.strip_chars('"').alias("id"), pl.col("field_1").cast(pl.Int64).alias("shard"))
        return table if table.height else None
    try:
        state = json.loads(text)
    except ValueError:
        return None
    if not isinstance(state, dict) or state.get("shards") != shards or not isinstance(state.get("assignment"), dict):
        return None
    previous = state["assignment"]
    if not previous or not all(isinstance(v, int) and not isinstance(v, bool) for v in previous.values()):
        return None
    return pl.DataFrame({"id": list(previous), "shard": list(previous.values())},
                        schema={"id": pl.String, "shard": pl.Int64})


#: The assignment's body as :func:`state_json` writes it for hex ids: ``"<hex>":<n>`` pairs, comma-separated.
_HEX_STATE = re.compile(r'"[0-9a-f]+":[0-9]+(?:,"[0-9a-f]+":[0-9]+)*')
_STATE_END = re.compile(r'\},"shards":[0-9]+\}$')


def _by_id(ids: pl.Series, shards: int) -> pl.Series:
    """Each id read as a hexadecimal integer, mod ``shards`` (:func:`diffpipe.data.cache.plan.shard_index`)."""
    as_int = ids.str.to_integer(base=16, dtype=pl.UInt64, strict=False)
    if not as_int.null_count():
        return (as_int % shards).cast(pl.Int64).alias("shard")
    return pl.Series("shard", [int(i, 16) % shards for i in ids], dtype=pl.Int64)  # ids over 64 bits


def shard_slices(items: pl.DataFrame, shards: int) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """Each shard's items as dicts, in id order: one shard's worth of Python objects at a time.

    ``items`` (in id order, with a ``shard`` column) is not sorted as a whole: that copied every column
    (0.6 KiB per item at 200,000 items). Only the row numbers are sorted by shard (a stable sort keeps the
    id order within a shard), and each shard's rows are gathered when its turn comes.
    """
    order = items.select(pl.col("shard"), pl.int_range(pl.len(), dtype=pl.UInt32).alias("row")).sort(
        "shard", maintain_order=True)
    bounds = order["shard"].search_sorted(pl.Series(range(shards + 1), dtype=pl.Int64)).to_list()
    rows, items = order["row"], items.drop("shard")
    del order
    for k in range(shards):
        yield k, items[rows.slice(bounds[k], bounds[k + 1] - bounds[k])].to_dicts()


def state_json(ids: pl.Series, shard: pl.Series, shards: int) -> str:
    """The plan state file's text, ``{"assignment": {id: shard}, "shards": n}`` as
    :func:`diffpipe.utils.stable_json` writes it, without a Python dict of every item."""
    frame = pl.DataFrame({"id": ids, "shard": shard}).sort("id")
    if not frame["id"].str.contains(r"^[0-9a-f]+$").all():  # an id JSON would escape: let json write it
        assignment = dict(zip(frame["id"].to_list(), frame["shard"].to_list(), strict=True))
        return json.dumps({"assignment": assignment, "shards": shards}, sort_keys=True, separators=(",", ":"))
    pairs = (pl.lit('"') + pl.col("id") + pl.lit('":') + pl.col("shard").cast(pl.String)).str.join(",")
    return '{"assignment":{' + (frame.select(pairs).item() or "") + '},"shards":' + str(shards) + "}"


def kept(items: pl.DataFrame) -> tuple[pl.DataFrame, int]:
    """The items validation kept, and how many it skipped."""
    keep = pl.col("status") != "skipped"
    return items.filter(keep), items.height - items.filter(keep).height


def clips(items: pl.DataFrame) -> list[dict[str, Any]]:
    """The rows of clips of more than one frame (those whose windows may come out empty), in id order."""
    return items.filter(pl.col("frames").fill_null(1) > 1).to_dicts()


def without(items: pl.DataFrame, ids: list[str]) -> pl.DataFrame:
    return items.filter(~pl.col("id").is_in(ids)) if ids else items


def count_train(items: pl.DataFrame) -> int:
    """Items of the training split (a manifest without splits: all of them)."""
    if "split" not in items.columns:
        return items.height
    return items.filter(pl.col("split").fill_null("train") == "train").height
