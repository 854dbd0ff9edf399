"""The validation manifest as a polars table: built chunk by chunk, then checked and counted column-wise.

Validation holds one Python dict per item only while a chunk of items (:data:`CHUNK`) is probed and
checked one by one (captions read, geometry, tokens); each chunk then becomes columns
(:func:`rows_frame`) and its dicts are dropped. What needs every row runs on the whole table: the
duplicates (a window over content keys), each row's status, the counts per dataset, the issues of
flagged rows; the comparison with the previous manifest reads its file a slice at a time
(:func:`same_as_file`). The previous manifest's reused columns (:data:`REUSED`) are a table too:
a folder's listing is joined to it on the relative path (:func:`align`), a table dataset's rows are
looked up by their content-keyed item id (:func:`lookup_ids`), and only the chunk at hand becomes dicts.
"""

from __future__ import annotations

import os
from collections import ChainMap, Counter
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from diffpipe.data.dataset.discover import Listing
from diffpipe.data.dataset.manifest_file import MANIFEST_SCHEMA
from diffpipe.data.dataset.results import Issue
from diffpipe.policy import Action
from diffpipe.utils import atomic_path

#: Items whose dicts live at once: enough to keep the probe pool busy, small next to the dataset.
CHUNK = 8192
#: The manifest's columns as polars types (Int32 sizes, list and struct columns).
SCHEMA = pl.from_arrow(MANIFEST_SCHEMA.empty_table()).schema
#: The probe columns of a validation shard's table, in the order :func:`chunk_lookups` hands them on.
PROBE_COLUMNS = ("size", "mtime_ns", "kind", "sha256", "width", "height", "frames", "fps", "reasons", "notes")
_KEPT = ("ok", "warning")
#: Manifest rows converted to Arrow at once when the manifest is written (one row group each): the
#: conversion copies every column, so a slice of it costs a slice's memory, not a second whole table.
WRITE_ROWS = 131_072
#: The previous manifest's columns validation reads back (probe, caption, token and aux file reuse; the join
#: keys). The locator, the caption text and its hash, the split and the status are always computed anew, so a
#: rerun does not hold them for every previous row (0.17 KiB of a table row's 0.5).
REUSED = tuple(c for c in MANIFEST_SCHEMA.names if c not in ("path", "caption", "caption_sha256", "split", "status"))


#: A folder listing's files as columns (:class:`FolderFiles`): the kind takes a byte a row.
FILES_SCHEMA = {"relpath": pl.String, "stem": pl.String, "kind": pl.Enum(["image", "video", "caption"]),
                "size": pl.Int64, "mtime_ns": pl.Int64}


class FolderFiles:
    """A dataset folder's media and caption files as columns (:data:`FILES_SCHEMA`), filled by the walk a batch
    at a time (the ``batch`` of :func:`diffpipe.data.dataset.discover.list_dataset`).

    As Python objects (a path string, a (size, mtime) tuple and dict entries per file) a listing held ~0.5 KiB
    an item through the whole scan; as columns it holds what the paths' bytes and two integers need.
    """

    def __init__(self) -> None:
        self.parts: list[pl.DataFrame] = []

    def add(self, media: dict[str, str], captions: list[str], stats: dict[str, tuple[int, int]]) -> None:
        rels = [*media, *captions]
        self.parts.append(files_frame(rels, [*media.values(), *["caption"] * len(captions)], stats))

    def tables(self) -> tuple[pl.DataFrame, pl.DataFrame]:
        """(media files, caption files), each sorted by relative path; the batches are let go."""
        files = pl.concat(self.parts) if self.parts else pl.DataFrame(schema=FILES_SCHEMA)
        self.parts = []
        is_caption = pl.col("kind") == "caption"
        return files.filter(~is_caption).sort("relpath"), files.filter(is_caption).sort("relpath")


def files_frame(rels: list[str], kinds: list[str], stats: dict[str, tuple[int, int]]) -> pl.DataFrame:
    """Files as :data:`FILES_SCHEMA` columns (``stem``: the path without its extension, as ``os.path.splitext``
    cuts it); size and mtime null where ``stats`` has none."""
    st = [stats.get(r) for r in rels]
    return pl.DataFrame({"relpath": rels, "stem": [os.path.splitext(r)[0] for r in rels], "kind": kinds,
                         "size": [s[0] if s else None for s in st], "mtime_ns": [s[1] if s else None for s in st]},
                        schema=FILES_SCHEMA)


def not_listed(files: pl.DataFrame, rels: Iterable[str]) -> list[str]:
    """The paths of ``rels`` that are not rows of ``files`` (in their order)."""
    rels = list(rels)
    if not rels:  # a folder without a metadata table: no copy of the path column to search
        return []
    series = pl.Series([r for r in rels if _utf8(r)], dtype=pl.String)  # a lone surrogate is no polars string,
    missing = set(series.filter(~series.is_in(files["relpath"].implode())).to_list())  # nor a listed file
    return [r for r in rels if r in missing or not _utf8(r)]


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def without(files: pl.DataFrame, rels: set[str]) -> pl.DataFrame:
    """``files`` less the rows of the paths ``rels``."""
    drop = sorted(r for r in rels if _utf8(r))
    return files.filter(~pl.col("relpath").is_in(drop)) if drop else files


def with_files(files: pl.DataFrame, rels: list[str], kind: str) -> pl.DataFrame:
    """``files`` and the files ``rels`` (of ``kind``, no stats), sorted by path."""
    return pl.concat([files, files_frame(rels, [kind] * len(rels), {})]).sort("relpath") if rels else files


def with_captions(media: pl.DataFrame, captions: pl.DataFrame) -> tuple[pl.DataFrame, list[str]]:
    """Each media file with its same-stem caption file (``caption_file``, ``caption_size``,
    ``caption_mtime_ns``; null when it has none), and the caption files no media file shares a stem with.
    Of two caption files with one stem (``a.txt``, ``a.TXT``) the later in path order is the stem's."""
    caps = captions.unique("stem", keep="last", maintain_order=True)
    orphans = caps.join(media.select("stem"), on="stem", how="anti", maintain_order="left")["relpath"].to_list()
    caps = caps.select("stem", caption_file="relpath", caption_size="size", caption_mtime_ns="mtime_ns")
    return media.join(caps, on="stem", how="left", maintain_order="left").drop("stem"), orphans


def read_manifest(path: Path | None, columns: tuple[str, ...] | None = None
                  ) -> tuple[pl.DataFrame | None, dict[str, str]]:
    """A previous manifest (sorted by id, as written; only ``columns`` when given) and its metadata; (None, {})
    when absent, damaged or of another layout: either only costs the reuse."""
    if path is None or not path.is_file():
        return None, {}
    try:
        schema = pq.read_schema(path)
        if schema.remove_metadata() != MANIFEST_SCHEMA:
            return None, {}
        # polars' own reader: one copy of the columns (through Arrow, two would be alive at the peak)
        table = pl.read_parquet(path, columns=list(columns) if columns else None, use_pyarrow=False,
                                glob=False)  # a path with [ ] * ?, never a pattern
    except Exception:
        return None, {}
    return _nulls_typeless(table), {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()}


def _nulls_typeless(table: pl.DataFrame) -> pl.DataFrame:
    """``table`` with its columns that hold no value as polars' Null type (no buffer; see :func:`rows_frame`)."""
    if not table.height:
        return table
    empty_cols = [name for name, n in zip(table.columns, table.null_count().row(0), strict=True) if n == table.height]
    return table.with_columns(pl.repeat(None, table.height, dtype=pl.Null, eager=True).alias(c) for c in empty_cols)


def rows_frame(rows: list[dict[str, Any]]) -> pl.DataFrame:
    """A chunk of manifest row dicts as columns (keys outside the manifest are left out).

    A column without a value in the chunk is of polars' Null type, which holds no buffer: as a String or
    integer column its nulls cost 4-16 bytes a row, and most manifests leave ~30 columns empty (fps of
    images, every aux role's six, tokens without a tokenizer): 0.3 KiB per item at 100,000 files.
    :func:`concat` widens them where another chunk has values; :func:`to_arrow` writes them in the schema.
    """
    columns = {name: [row.get(name) for row in rows] for name in SCHEMA}
    return pl.DataFrame({name: pl.Series(name, values, dtype=SCHEMA[name] if any(v is not None for v in values)
                                         else pl.Null) for name, values in columns.items()})


def empty() -> pl.DataFrame:
    return pl.DataFrame(schema=SCHEMA)


def concat(parts: list[pl.DataFrame]) -> pl.DataFrame:
    """The chunks' tables as one (an empty manifest when there is none)."""
    return pl.concat(parts, how="vertical_relaxed") if parts else empty()  # a Null column takes another's type


def align(dataset: str, files: pl.DataFrame, prev: pl.DataFrame | None, probes: pl.DataFrame | None
          ) -> pl.DataFrame:
    """A folder's media files (``files``, rows in order; a ``relpath`` column) joined on their relative path to
    the index of the previous manifest's row (``prev_row``: the rows stay where they are, not copied) and to a
    validation shard's probe (``probe_*`` columns)."""
    out = files
    if prev is not None:
        mine = prev.select("dataset", "relpath").with_row_index("prev_row").filter(pl.col("dataset") == dataset)
        out = out.join(mine.drop("dataset"), on="relpath", how="left", maintain_order="left")
    if probes is not None:
        mine = probes.filter(pl.col("dataset") == dataset).select("relpath", *PROBE_COLUMNS)
        out = out.join(mine.rename({c: f"probe_{c}" for c in PROBE_COLUMNS}), on="relpath", how="left",
                       maintain_order="left")
    return out


def chunk_lookups(part: pl.DataFrame, prev: pl.DataFrame | None
                  ) -> tuple[dict[str, dict[str, Any]], dict[str, tuple[Any, ...]]]:
    """A slice of :func:`align`'s table as the per-item values the checks read: previous rows (of ``prev``) by
    item id, and shard probes by relative path (:data:`PROBE_COLUMNS` order)."""
    found: dict[str, dict[str, Any]] = {}
    if prev is not None and "prev_row" in part.columns:
        rows = prev[part["prev_row"].drop_nulls()].to_dicts()
        found = {row["id"]: row for row in rows}
    probed: dict[str, tuple[Any, ...]] = {}
    if "probe_size" in part.columns:
        hits = part.filter(pl.col("probe_size").is_not_null()).select("relpath", *(f"probe_{c}" for c in PROBE_COLUMNS))
        probed = {row[0]: row[1:] for row in hits.iter_rows()}
    return found, probed


def chunk_listing(listing: Listing, part: pl.DataFrame) -> tuple[Listing, dict[str, str]]:
    """A chunk of a folder's media files (a slice of :func:`align`'s table) as the listing the
    per-item steps read: its media files, their and their caption files' stats before the aux folders' ones;
    and its caption files by media stem."""
    media: dict[str, str] = {}
    stats: dict[str, tuple[int, int]] = {}
    captions: dict[str, str] = {}
    cols = ("relpath", "kind", "size", "mtime_ns", "caption_file", "caption_size", "caption_mtime_ns")
    for rel, kind, size, mtime, crel, csize, cmtime in part.select(cols).iter_rows():
        media[rel] = kind
        if size is not None:
            stats[rel] = (size, mtime)
        if crel is not None:
            captions[os.path.splitext(rel)[0]] = crel
            if csize is not None:
                stats[crel] = (csize, cmtime)
    return replace(listing, media=media, stats=ChainMap(stats, listing.stats)), captions


def lookup_ids(prev: pl.DataFrame | None, dataset: str) -> Callable[[list[str]], dict[str, dict[str, Any]]]:
    """Previous rows of ``dataset`` by item id, for ids known only once their content is hashed (table rows).

    The manifest is sorted by id, so each chunk is a binary search, not a scan of every previous row.
    """
    mine = prev.filter(pl.col("dataset") == dataset) if prev is not None else empty()

    def find(ids: list[str]) -> dict[str, dict[str, Any]]:
        if not ids or mine.height == 0:
            return {}
        want = pl.Series("id", ids, dtype=pl.String)
        at = mine["id"].search_sorted(want).clip(0, mine.height - 1)
        hit = mine[at].filter(pl.col("id") == want)
        return {row["id"]: row for row in hit.to_dicts()}

    return find


def flag_duplicates(df: pl.DataFrame) -> pl.DataFrame:
    """Flag every copy after the first (by dataset, relative path) of a content hash, and of a caption on other
    media: ``duplicate_media`` / ``duplicate_caption``, the note naming the first copy."""
    media = pl.col("sha256").is_not_null() & (pl.col("size").fill_null(0) != 0)
    # Only the key columns are sorted (not the whole table, twice): the new reasons go back by row index.
    keys = (df.select("dataset", "relpath", "path", "sha256", "size", "caption").with_row_index("_i")
            .sort("dataset", "relpath").with_columns(_mk=pl.when(media).then(pl.col("sha256"))))
    keys = keys.with_columns(
        _dm=pl.col("_mk").is_not_null() & (pl.int_range(pl.len()).over("_mk") > 0),
        _mo=pl.col("path").first().over("_mk"),
    )
    keys = keys.with_columns(
        _ck=pl.when(~pl.col("_dm") & (pl.col("caption").fill_null("") != "")).then(pl.col("caption")))
    keys = keys.with_columns(
        _dc=pl.col("_ck").is_not_null() & (pl.int_range(pl.len()).over("_ck") > 0),
        _co=pl.col("path").first().over("_ck"),
    )
    reason = pl.when(pl.col("_dm")).then(pl.lit("duplicate_media")).when(pl.col("_dc")).then(pl.lit("duplicate_caption"))
    note = (pl.when(pl.col("_dm")).then(pl.lit("same content (SHA-256) as ") + pl.col("_mo"))
            .when(pl.col("_dc")).then(pl.lit("same caption as ") + pl.col("_co")))
    found = keys.select("_i", _r=reason, _n=note).sort("_i")
    added = found["_r"].is_not_null()
    return df.with_columns(
        reasons=pl.when(added).then(pl.col("reasons").list.concat(pl.concat_list(found["_r"])))
        .otherwise(pl.col("reasons")),
        notes=pl.when(added).then(pl.col("notes").list.concat(pl.concat_list(found["_n"]))).otherwise(pl.col("notes")),
    )


def with_status(df: pl.DataFrame, actions: dict[str, Action]) -> pl.DataFrame:
    """Each row's status from its reasons' actions: ``error`` > ``skipped`` > ``warning`` > ``ok``
    (:func:`diffpipe.policy.status_of`, column-wise)."""

    def any_of(action: str) -> pl.Expr:
        codes = [code for code, a in actions.items() if a == action]
        return pl.col("reasons").list.eval(pl.element().is_in(codes)).list.any()

    status = (pl.when(any_of("error")).then(pl.lit("error")).when(any_of("skip")).then(pl.lit("skipped"))
              .when(pl.col("reasons").list.len() > 0).then(pl.lit("warning")).otherwise(pl.lit("ok")))
    return df.with_columns(status=status)


def row_issues(df: pl.DataFrame, actions: dict[str, Action]) -> list[Issue]:
    """One :class:`Issue` per reason of every flagged row."""
    flagged = (df.filter(pl.col("reasons").list.len() > 0)
               .select("dataset", "path", "reasons", "notes", "sha256", "kind").explode("reasons", "notes"))
    return [Issue(d, p, r, n, actions[r], s, k) for d, p, r, n, s, k in flagged.iter_rows()]


def dataset_counts(df: pl.DataFrame, names: list[str]) -> dict[str, dict[str, int]]:
    """Items, kept, skipped and eval items per dataset (every name, zeros for an empty one)."""
    counts = df.select("dataset", "status", "split").group_by("dataset").agg(
        items=pl.len(), kept=pl.col("status").is_in(_KEPT).sum(), eval=(pl.col("split") == "eval").sum())
    found = {row["dataset"]: row for row in counts.to_dicts()}
    out = {}
    for name in names:
        c = found.get(name, {"items": 0, "kept": 0, "eval": 0})
        out[name] = {"items": c["items"], "kept": c["kept"], "skipped": c["items"] - c["kept"], "eval": c["eval"]}
    return out


def unusable_note(df: pl.DataFrame, dataset: str, actions: dict[str, Action]) -> str | None:
    """Why ``dataset`` has no item left to train on (the counts per skipping reason), or None when it has one
    or holds no item at all (that is ``no_media``). Run once every row has its status."""
    mine = df.filter(pl.col("dataset") == dataset)
    if mine.height == 0 or mine.filter(pl.col("status").is_in(_KEPT) & (pl.col("split") == "train")).height:
        return None
    skipped = mine.filter(~pl.col("status").is_in(_KEPT))
    why = Counter(code for reasons in skipped["reasons"].to_list() for code in dict.fromkeys(reasons)
                  if actions[code] != "warn")
    detail = f" ({', '.join(f'{code} {n}' for code, n in why.most_common())})" if why else ""
    return (f"dataset {dataset}: {mine.height} found, {skipped.height} skipped{detail}, "
            f"{mine.height - skipped.height} held out for eval, 0 usable for training; fix the files the report "
            "lists (or the config's validation.actions, eval_files, eval_fraction)")


def take_sorted(held: list[pl.DataFrame], key: str) -> pl.DataFrame:
    """The one table in ``held`` (taken out of it) sorted by ``key``, a column at a time.

    ``DataFrame.sort`` gathers every column before the unsorted ones are dropped, so the whole table
    lives twice at the peak; here each column is freed once its sorted copy is made, so the peak holds one
    column twice. The caller hands the table over in a list: a reference it kept would keep every column.
    """
    df = held.pop()
    order = df.get_column(key).arg_sort()
    out: list[pl.Series] = []
    for name in df.columns:
        col = df.get_column(name)
        if col.dtype.is_nested():  # a list column of many chunks (one per scan chunk) gathers through a builder
            col = col.rechunk()  # that held ~0.7 KiB a row even for empty lists; in one chunk, a few bytes
        out.append(col.gather(order))
        col, df = None, df.drop(name)  # the last references to the unsorted column
    return pl.DataFrame(out)


def present(parts: list[pl.DataFrame], wanted: set[str]) -> set[str]:
    """Which of the relative paths ``wanted`` are rows of ``parts``."""
    if not wanted or not parts:
        return set()
    rels = pl.concat([p.select("relpath") for p in parts])["relpath"]
    return set(rels.filter(rels.is_in(sorted(wanted))).to_list())


def to_arrow(df: pl.DataFrame, meta: dict[str, str]) -> pa.Table:
    """The manifest table as Parquet stores it: exactly :data:`MANIFEST_SCHEMA`, with ``meta``."""
    return df.to_arrow(compat_level=pl.CompatLevel.oldest()).cast(MANIFEST_SCHEMA.with_metadata(meta))


def same_as_file(path: Path, df: pl.DataFrame, meta: dict[str, str]) -> bool:
    """Whether the manifest file at ``path`` holds ``df`` in :data:`MANIFEST_SCHEMA` with ``meta``, read
    :data:`WRITE_ROWS` rows at a time (the previous manifest is not held whole for the comparison; polars reads
    them, as its allocator returns freed pages where Arrow's pool keeps them)."""
    try:
        with pq.ParquetFile(path) as f:
            schema, rows = f.schema_arrow, f.metadata.num_rows
        held = {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()}
        if rows != df.height or schema.remove_metadata() != MANIFEST_SCHEMA or held != meta:
            return False
        lazy = pl.scan_parquet(path, glob=False)  # a path with [ ] * ?, never a pattern
        for start in range(0, df.height, WRITE_ROWS):
            if not lazy.slice(start, WRITE_ROWS).collect().equals(df.slice(start, WRITE_ROWS).cast(SCHEMA)):
                return False
    except Exception:  # damaged or unreadable: not the same, so it is written anew
        return False
    return True


def write_frame(path: Path, df: pl.DataFrame, meta: dict[str, str]) -> None:
    """Write the manifest table as Parquet in :data:`MANIFEST_SCHEMA` with ``meta``, atomically, converting
    :data:`WRITE_ROWS` rows to Arrow at a time (the file reads back as :func:`to_arrow` of the whole)."""
    with atomic_path(path) as tmp, pq.ParquetWriter(tmp, MANIFEST_SCHEMA.with_metadata(meta)) as writer:
        for start in range(0, df.height, WRITE_ROWS):
            writer.write_table(to_arrow(df.slice(start, WRITE_ROWS), meta))
