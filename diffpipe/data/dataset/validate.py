"""Dataset validation: fingerprint every file, flag every problem, write the manifest.

Each media file becomes one manifest row with its content hash, size,
geometry, captions, token counts, split and status. Problems carry a stable
reason code (:mod:`diffpipe.policy`) whose action decides the row's
status: ``skip`` leaves it out of training, ``warn`` keeps it, ``error``
stops the run. Nothing in a dataset is ever modified.

Incremental: a media file whose size and mtime_ns match the previous
manifest reuses its hash and probe results without reading its content; so
does a caption file, and token counts are reused while the captions and the
model config are unchanged. New or changed files are probed by a pool of
worker processes (:mod:`diffpipe.data.dataset.pool`, :func:`diffpipe.data.dataset.media.probe`);
the checks over probed rows live in :mod:`diffpipe.data.dataset.checks`.

Items are validated a chunk at a time: only a chunk's rows are Python dicts while they are probed and
checked; the manifest, the previous manifest and the checks that need every row (duplicates, statuses,
counts) are polars tables (:mod:`diffpipe.data.dataset.columnar`), so memory per item is what its
columns hold.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from diffpipe.config import DatasetConfig, ValidationConfig
from diffpipe.data.dataset import aux_images, table_items
from diffpipe.data.dataset import captions as cap
from diffpipe.data.dataset.checks import (
    PROBE_REASONS,
    TokenCounter,
    add_reason,
    assign_split,
    check_geometry,
    check_tokens,
    eval_files,
    missing_eval_files,
)
from diffpipe.data.dataset.discover import Listing, list_dataset, printable
from diffpipe.data.dataset.manifest_file import write_manifest
from diffpipe.data.dataset.metadata import MetadataTable, read_metadata
from diffpipe.data.dataset.pool import probe_files
from diffpipe.data.dataset.report import write_reports
from diffpipe.data.dataset.results import Issue, ValidationResult
from diffpipe.policy import REASONS, resolve_actions
from diffpipe.utils import digest

if TYPE_CHECKING:
    import polars as pl

    from diffpipe.data.dataset import columnar

#: Bump when probing changes, so a new version re-probes every file.
#: 4: declared sizes checked from headers (GIF frames, video streams); ``large_media``.
PROBE_VERSION = 4
#: Reasons found by reading a caption file, reused likewise.
_CAPTION_REASONS = {"empty_caption", "caption_not_utf8"}
#: Per-item auxiliary images (:mod:`diffpipe.data.dataset.aux_images`).
AUX_ROLES = aux_images.ROLES

def probe_key(vcfg: ValidationConfig) -> str:
    """What makes a probe result reusable: the probing code's version and the pixel limit."""
    return digest([PROBE_VERSION, vcfg.max_pixels])[:16]


def kept_copy(path: Path) -> Path:
    """Where a run with errors keeps a copy of ``path`` (``report.html`` -> ``report.failed.html``)."""
    return path.with_name(f"{path.stem}.failed{path.suffix}")


def item_id(dataset: str, relpath: str) -> str:
    """Stable item id: a digest of the dataset name and the file's relative path."""
    return digest([dataset, relpath])[:16]


# -- per-dataset collection ----------------------------------------------------
def _stat(path: str) -> tuple[int, int]:
    try:
        st = os.stat(path)
        return st.st_size, st.st_mtime_ns
    except OSError:
        return 0, 0


def _collect(
    ds: DatasetConfig,
    root: str,
    listing: Listing,
    media: dict[str, str],
    rels: list[str],
    previous: dict[str, dict[str, Any]],
    reuse_probe: bool,
    probed: dict[str, tuple[Any, ...]],
) -> tuple[list[dict[str, Any]], list[tuple[int, str, str]]]:
    """Manifest rows of a chunk of one dataset's media files (``rels``) with reused probe results (the
    previous manifest's rows of the chunk, then the validation shards' in ``probed``), and what must be probed."""
    rows: list[dict[str, Any]] = []
    jobs: list[tuple[int, str, str]] = []
    known = {r["relpath"]: rid for rid, r in previous.items()}
    for rel in rels:
        kind = media[rel]
        path = os.path.join(root, rel)
        size, mtime = listing.stats.get(rel) or _stat(path)
        rid = known.get(rel) or item_id(ds.name, rel)  # the digest costs more than the lookup
        row: dict[str, Any] = {
            "id": rid, "dataset": ds.name, "path": path, "relpath": rel, "kind": kind, "size": size,
            "mtime_ns": mtime, "sha256": None, "width": None, "height": None, "frames": None, "fps": None,
            "reasons": [], "notes": [],
        }
        if not _reused(row, previous.get(rid) if reuse_probe else None, probed.get(rel)):
            jobs.append((len(rows), path, kind))
        rows.append(row)
    return rows, jobs


def _named_file(listing: Listing, meta: MetadataTable, rel: str, issue: Any) -> bool:
    """Whether ``rel``, named by a metadata table but not listed as media, is a file (it is then an image item:
    sniffing decides); a ``missing_file`` issue when it is not."""
    try:
        if (listing.root / rel).is_file():
            return True
        why = "does not exist"
    except OSError as err:  # a name too long for the file system, ...
        why = f"cannot be a file ({err.strerror or err})"
    issue(str(listing.root / rel), "missing_file", f"{meta.where[rel]}: {rel!r} {why} in {listing.root}")
    return False


def _reused(row: dict[str, Any], prev: dict[str, Any] | None, shard: tuple[Any, ...] | None) -> bool:
    """Fill ``row``'s probe results from the previous manifest's row or a validation shard's table while the file
    keeps the size and mtime they recorded; False when it must be probed."""
    size, mtime = row["size"], row["mtime_ns"]
    if prev and prev["sha256"] and prev["size"] == size and prev["mtime_ns"] == mtime:
        for k in ("sha256", "kind", "width", "height", "frames", "fps"):
            row[k] = prev[k]
        for reason, note in zip(prev["reasons"], prev["notes"], strict=True):
            if reason in PROBE_REASONS:
                add_reason(row, reason, note)
        row["_reused"] = True
        return True
    if shard and shard[0] == size and shard[1] == mtime:
        for k, value in zip(("kind", "sha256", "width", "height", "frames", "fps"), shard[2:8], strict=True):
            row[k] = value
        for reason, note in zip(shard[8], shard[9], strict=True):
            add_reason(row, reason, note)
        row["_sharded"] = True
        return True
    return False


def _captions(
    ds: DatasetConfig,
    listing: Listing,
    meta: MetadataTable,
    files: dict[str, str],
    rows: list[dict[str, Any]],
    previous: dict[str, dict[str, Any]],
    caption_key_same: bool,
    result: ValidationResult,
) -> None:
    """Attach captions: metadata first, then same-stem files (``files``: stem -> caption file)."""
    for row in rows:
        rel = row["relpath"]
        stem = os.path.splitext(rel)[0]
        row.update(caption_file=None, caption_size=None, caption_mtime_ns=None)
        if rel in meta.captions:
            c = cap.from_metadata(
                meta.captions[rel],
                where=meta.where[rel],
                lines=ds.caption_lines,
                style=ds.caption_style,
            )
            texts, reason, note = list(c.texts), c.reason, c.note
        elif stem in files:
            texts, reason, note = _caption_file(ds, listing, row, files[stem], previous, caption_key_same, result)
        else:
            texts, reason = [], "missing_caption"
            where = f" and no row in {', '.join(meta.files)}" if meta.files else ""
            note = f"no caption file {Path(stem).name}{ds.caption_ext} next to it{where}"
        if reason:
            add_reason(row, reason, note)
        row["captions"] = texts
        row["caption"] = texts[0] if texts else ""
        row["caption_sha256"] = cap.caption_hash(texts)


def _caption_file(
    ds: DatasetConfig,
    listing: Listing,
    row: dict[str, Any],
    crel: str,
    previous: dict[str, dict[str, Any]],
    caption_key_same: bool,
    result: ValidationResult,
) -> tuple[list[str], str | None, str | None]:
    """A row's captions from its same-stem caption file ``crel`` (texts, problem reason, note): the previous
    run's when the file and the caption settings are unchanged, else read and decoded (counted in
    ``result.captions_read``). Records the file's stat in the row."""
    size, mtime = listing.stats.get(crel) or _stat(os.path.join(str(listing.root), crel))
    row.update(caption_file=crel, caption_size=size, caption_mtime_ns=mtime)
    prev = previous.get(row["id"])
    if (
        caption_key_same
        and prev
        and prev["caption_file"] == crel
        and prev["caption_size"] == size
        and prev["caption_mtime_ns"] == mtime
        and "unreadable" not in prev["reasons"]
    ):
        both = zip(prev["reasons"], prev["notes"], strict=True)
        reason, note = next(((r, n) for r, n in both if r in _CAPTION_REASONS), (None, None))
        return list(prev["captions"] or []), reason, note
    result.captions_read += 1
    try:
        data = (listing.root / crel).read_bytes()
    except OSError as err:
        return [], "unreadable", f"cannot read caption file {crel}: {err.strerror or err}"
    c = cap.decode_caption(data, name=f"caption file {crel}", lines=ds.caption_lines, style=ds.caption_style)
    return list(c.texts), c.reason, c.note


# -- entry point -----------------------------------------------------------------
@dataclass
class _Scan:
    """One validation run's working state, passed through its named steps."""

    vcfg: ValidationConfig
    result: ValidationResult
    #: The previous manifest (sorted by id), None when there is none to reuse.
    prev: pl.DataFrame | None
    reuse_probe: bool
    tokens: TokenCounter | None
    prefixes: dict[str, str]
    workers: int | None = None
    console: Console | None = None
    #: (dataset, path, reason, note) not tied to a manifest row.
    extra: list[tuple[str, str, str, str]] = field(default_factory=list)
    #: The manifest's rows, a polars table per chunk.
    parts: list[pl.DataFrame] = field(default_factory=list)
    #: Validation shards' probes (:func:`diffpipe.data.dataset.vshards.load_probes`), None when none.
    probed: pl.DataFrame | None = None
    #: The tokenizers start loading while the first files are probed.
    prefetched: bool = False
    #: Validation shards' probe tables, in shard order (table datasets read them per table file).
    probe_paths: tuple[Path, ...] = ()
    #: Each listed dataset's root folder.
    roots: dict[str, Path] = field(default_factory=dict)

    def issue_for(self, dataset: str):
        """A callback that records a dataset-level issue ``(path, reason, note)`` of ``dataset``."""
        return lambda path, reason, note: self.extra.append((dataset, path, reason, note))


def run_validation(
    datasets: list[DatasetConfig],
    vcfg: ValidationConfig,
    *,
    manifest_path: str | Path,
    report_json: str | Path,
    report_html: str | Path,
    previous: str | Path | Literal["auto"] | None = "auto",
    rehash: bool = False,
    tokens: TokenCounter | None = None,
    workers: int | None = None,
    console: Console | None = None,
    exclude: tuple[str, ...] = (),
    probes: tuple[Path, ...] = (),
) -> ValidationResult:
    """Scan datasets, write the manifest and both reports, return the counts.

    Per dataset (:func:`_validate_dataset`), a chunk of files at a time: list, reuse or probe, check
    (:func:`_check_chunk`); then over the whole table: duplicates, statuses, issues, counts (:func:`_tally`).

    Args:
        datasets: datasets to scan (names must be unique).
        vcfg: media extensions, limits and per-reason actions.
        manifest_path: Parquet manifest (one row per media file, sorted by id).
        report_json: machine-readable report (counts per reason, flagged files).
        report_html: self-contained page with thumbnails of flagged files, by reason.
        previous: manifest whose results are reused for unchanged files;
            ``"auto"`` uses ``manifest_path`` if it exists, None disables reuse.
        rehash: read every file even when its size and mtime are unchanged.
        tokens: counts caption tokens per text encoder (None: no length check).
        workers: probe processes (default: every core).
        console: where the progress bar goes (shown only on a terminal).
        exclude: the run's own folders (``discover.run_folders``), never listed as data.
        probes: validation shards' probe tables (:mod:`~diffpipe.data.dataset.vshards`), reused per file at its size+mtime.
    """
    # deferred: polars (start-up time of the CLI and of Snakemake's DAG, which import this module's callers)
    from diffpipe.data.dataset import columnar

    manifest_path = Path(manifest_path)
    prev_path = _previous_path(manifest_path, previous)
    prev, prev_meta = columnar.read_manifest(prev_path, columnar.REUSED)
    probe_key_now = probe_key(vcfg)
    caption_keys = {ds.name: digest([ds.caption_lines, ds.caption_style])[:16] for ds in datasets}
    prev_caption_keys = json.loads(prev_meta.get("caption_keys", "{}"))
    scan = _Scan(vcfg, ValidationResult(actions=resolve_actions(vcfg.actions), max_pixels=vcfg.max_pixels),
                 prev, reuse_probe=not rehash and prev_meta.get("probe_key") == probe_key_now, tokens=tokens,
                 prefixes={ds.name: ds.caption_prefix for ds in datasets}, workers=workers, console=console)
    if probes and not rehash:
        _use_shard_probes(scan, tuple(probes))
    for ds in datasets:
        same = not rehash and prev_caption_keys.get(ds.name) == caption_keys[ds.name]
        _validate_dataset(scan, ds, exclude, same)
    compared = prev_path == manifest_path and prev is not None  # else the file may hold these rows still
    scan.prev = prev = scan.probed = None  # read only by the scan: freed before the whole-table checks
    table = _tally(scan, datasets)
    meta = _manifest_meta(probe_key_now, caption_keys, vcfg)
    unchanged = compared and prev_meta == meta and columnar.same_as_file(manifest_path, table, meta)
    _write_outputs(scan.result, table, meta, unchanged, compared, manifest_path, Path(report_json),
                   Path(report_html))
    return scan.result


def _manifest_meta(probe_key_now: str, caption_keys: dict[str, str], vcfg: ValidationConfig) -> dict[str, str]:
    """The manifest's metadata: what decides reuse next time, and ``max_pixels`` (the plan hands it to the cache
    jobs' decoders)."""
    return {"probe_key": probe_key_now, "caption_keys": json.dumps(caption_keys, sort_keys=True),
            "max_pixels": str(vcfg.max_pixels)}


def _use_shard_probes(scan: _Scan, probes: tuple[Path, ...]) -> None:
    """Reuse the validation shards' probe tables (:func:`diffpipe.data.dataset.vshards.load_probes`):
    folder files' probes loaded now, table files' rows read per file as each table is scanned."""
    from diffpipe.data.dataset.vshards import load_probes  # deferred: the decoders (start-up time)

    scan.probed = load_probes(list(probes), scan.vcfg)
    scan.probe_paths = probes


def _previous_path(manifest_path: Path, previous: str | Path | None) -> Path | None:
    """The manifest whose results are reused (``"auto"``: the output itself, else its kept copy)."""
    if previous != "auto":
        return Path(previous) if previous else None
    keep = kept_copy(manifest_path)
    if not manifest_path.is_file() and keep.is_file():
        return keep  # Snakemake removed the outputs of a failed run; its results still count
    return manifest_path


def _validate_dataset(scan: _Scan, ds: DatasetConfig, exclude: tuple[str, ...], same_captions: bool) -> None:
    """List one dataset (folder or table), then validate its files a chunk at a time; its listing issues."""
    from diffpipe.data.dataset import columnar  # deferred: polars (see run_validation)

    issue = scan.issue_for(ds.name)
    files = columnar.FolderFiles()  # the folder's media and captions, as columns
    listing = list_dataset(ds, scan.vcfg, with_stats=True, exclude=exclude, batch=files.add)
    if not listing.root_ok:
        reason, note = listing.error or (
            "missing_dataset",
            f"dataset folder {listing.root} does not exist or is not a folder",
        )
        issue(str(listing.root), reason, note)
        return
    scan.roots[ds.name] = listing.root
    if listing.table:
        _table_dataset(scan, ds, listing, issue)
        return
    for found in listing.problems:
        issue(str(listing.root / found.rel), found.reason, found.note)
    meta_files = [ds.metadata] if ds.metadata else listing.metadata
    aux_columns = {r: c for r in ds.aux_roles() if (c := ds.aux_source(r)[1])}
    meta = read_metadata(
        listing.root, meta_files, ds.file_column, ds.caption_column, aux_columns, link_root=listing.link_root
    )
    for prob in meta.problems:
        path = prob.where if os.path.isabs(prob.where) else str(listing.root / prob.where)
        issue(path, prob.reason, prob.note)
    _folder_chunks(scan, ds, listing, files, meta, issue, same_captions)


def _media_files(listing: Listing, files: columnar.FolderFiles, meta: MetadataTable, issue: Any) -> pl.DataFrame:
    """The folder's media files with their caption files' columns (:func:`columnar.with_captions`), sorted by
    path: the listed ones less the aux images metadata names, and the files metadata names that were not listed
    (a missing one is a ``missing_file`` issue). A caption file without a media file is an ``orphan_caption``."""
    from diffpipe.data.dataset import columnar  # deferred: polars (see run_validation)

    media, captions = files.tables()
    media = columnar.without(media, aux_images.referenced_files(meta))  # masks / controls are not items
    named = [rel for rel in columnar.not_listed(media, meta.captions) if _named_file(listing, meta, rel, issue)]
    media, orphans = columnar.with_captions(columnar.with_files(media, named, "image"), captions)
    for crel in orphans:
        issue(str(listing.root / crel), "orphan_caption", f"caption file {crel} has no media file with the same name")
    return media


def _folder_chunks(scan: _Scan, ds: DatasetConfig, listing: Listing, files: columnar.FolderFiles,
                   meta: MetadataTable, issue: Any, same_captions: bool) -> None:
    """A folder dataset's rows (its media files: :func:`_media_files`), a chunk at a time, and the issues that
    need all of them."""
    from diffpipe.data.dataset import columnar  # deferred: polars (see run_validation)

    wanted, parts = eval_files(ds, listing.root), []
    aligned = columnar.align(ds.name, _media_files(listing, files, meta, issue), scan.prev, scan.probed)
    root = str(listing.root)
    for start in range(0, max(aligned.height, 1), columnar.CHUNK):
        part = aligned.slice(start, columnar.CHUNK)
        view, captions = columnar.chunk_listing(listing, part)
        previous, probed = columnar.chunk_lookups(part, scan.prev)
        rows, jobs = _collect(ds, root, view, view.media, list(view.media), previous, scan.reuse_probe, probed)
        aux_images.resolve(ds, view, meta, rows, issue if start == 0 else _quiet)
        aux_jobs = aux_images.reuse_or_probe(rows, view, previous, scan.reuse_probe)
        _probe(scan, rows, jobs, aux_jobs)
        _captions(ds, view, meta, captions, rows, previous, same_captions, scan.result)
        parts.append(_check_chunk(scan, ds, rows, wanted, previous))
    if not aligned.height:
        exts = ", ".join([*scan.vcfg.image_exts, *scan.vcfg.video_exts])
        issue(str(listing.root), "no_media", f"dataset folder {listing.root} holds no media files ({exts})")
    missing_eval_files(ds, wanted, columnar.present(parts, wanted), issue, listing.root)
    scan.parts += parts


def _quiet(*_: Any) -> None:
    """Drops the issues of a step repeated per chunk (a missing aux folder is one issue, not one per chunk)."""


def _table_dataset(scan: _Scan, ds: DatasetConfig, listing: Listing, issue: Any) -> None:
    """A table dataset's rows (Parquet, a saved or hub dataset), a chunk at a time."""
    from diffpipe.data.dataset import columnar  # deferred: polars (see run_validation)
    from diffpipe.data.dataset.tshards import file_probes  # deferred: polars (see run_validation)

    lookup = columnar.lookup_ids(scan.prev, ds.name)
    wanted, parts = eval_files(ds, listing.root), []
    covered = file_probes(list(scan.probe_paths), scan.vcfg, len(scan.probe_paths))
    chunks = table_items.collect(ds, listing.table, listing.root, lookup, scan.reuse_probe, issue, columnar.CHUNK,
                                 covered=lambda file, size, mtime: covered(ds.name, file, size, mtime))
    for rows, jobs, previous in chunks:
        for row in rows:
            row.update({f"{role}_{col}": None for role in AUX_ROLES for col in aux_images.COLUMNS})
        _probe(scan, rows, jobs, [])
        parts.append(_check_chunk(scan, ds, rows, wanted, previous))
    if not parts:
        issue(str(listing.root), "no_media", f"split {listing.table.split!r} of {listing.root} holds no rows")
    missing_eval_files(ds, wanted, columnar.present(parts, wanted), issue, listing.root)
    scan.parts += parts


def _probe(scan: _Scan, rows: list[dict[str, Any]], jobs: list[tuple[int, str, str]],
           aux_jobs: list[tuple[dict[str, Any], str, str]]) -> None:
    """Probe a chunk's queued media and aux files in parallel and write the results into their rows."""
    # New files likely bring new captions: load the tokenizers while the first ones are probed.
    prefetch = getattr(scan.tokens, "prefetch", None) if jobs and not scan.prefetched else None
    scan.prefetched |= prefetch is not None
    probes = probe_files(
        [(p, k) for _, p, k in jobs] + [(p, "image") for _, _, p in aux_jobs],
        scan.vcfg.max_pixels,
        scan.workers,
        scan.console,
        prefetch,
    )
    for (row, role, _), probe in zip(aux_jobs, probes[len(jobs) :], strict=True):
        aux_images.apply_probe(row, role, probe)
    for (i, _, _), probe in zip(jobs, probes[: len(jobs)], strict=True):
        row = rows[i]
        for k in ("sha256", "width", "height", "frames", "fps"):
            row[k] = probe[k]
        row["kind"] = probe["kind"] or row["kind"]
        for reason, note in probe["problems"]:
            add_reason(row, reason, note)
    scan.result.hashed += len(jobs) + len(aux_jobs)


def _check_chunk(scan: _Scan, ds: DatasetConfig, rows: list[dict[str, Any]], wanted: set[str],
                 previous: dict[str, dict[str, Any]]) -> pl.DataFrame:
    """Geometry, eval split and caption tokens of a chunk's rows (captions attached); the chunk as a table."""
    from diffpipe.data.dataset import columnar  # deferred: polars (see run_validation)

    for row in rows:
        check_geometry(ds, scan.vcfg, row)
        aux_images.check_geometry(row)
    assign_split(ds, rows, wanted)
    check_tokens(rows, scan.prefixes, scan.tokens, previous)
    scan.result.reused += sum(row.get("_reused", False) for row in rows)
    scan.result.sharded += sum(row.get("_sharded", False) for row in rows)
    return columnar.rows_frame(rows)


def _tally(scan: _Scan, datasets: list[DatasetConfig]) -> pl.DataFrame:
    """Duplicates and each row's status over the whole manifest, every issue, and the counts per dataset and
    in all; the manifest table, sorted by id."""
    from diffpipe.data.dataset import columnar  # deferred: polars (see run_validation)

    result, actions = scan.result, scan.result.actions
    table = columnar.concat(scan.parts)
    scan.parts = []
    table = columnar.with_status(columnar.flag_duplicates(table), actions)
    result.issues = columnar.row_issues(table, actions)
    for ds in datasets:
        if note := columnar.unusable_note(table, ds.name, actions):
            scan.issue_for(ds.name)(str(scan.roots[ds.name]), "no_usable_items", note)
    for ds_name, path, reason, note in scan.extra:
        result.issues.append(Issue(ds_name, printable(path), reason, note, actions[reason]))
    result.datasets = columnar.dataset_counts(table, [ds.name for ds in datasets])
    held, table = [table], None
    table = columnar.take_sorted(held, "id")  # column by column: not the whole table twice
    result.items = table.height
    result.kept = sum(c["kept"] for c in result.datasets.values())
    result.skipped = result.items - result.kept
    result.errors = sum(i.action == "error" for i in result.issues)
    result.warnings = sum(i.action == "warn" for i in result.issues)
    result.issues.sort(key=lambda i: (i.dataset, i.path, i.reason))
    return table


def _write_outputs(result: ValidationResult, table: pl.DataFrame, meta: dict[str, str], unchanged: bool,
                   compared: bool, manifest_path: Path, report_json: Path, report_html: Path) -> None:
    """The manifest (left as is, only touched, when nothing changed; not read back when ``compared`` with it
    already) and both reports; on errors, kept copies Snakemake does not know about."""
    from diffpipe.data.dataset import columnar  # deferred: polars (see run_validation)

    if unchanged:
        os.utime(manifest_path)  # newer than its inputs for Snakemake, same content
        result.manifest_changed = False
    elif compared or not manifest_path.is_file():  # known to differ: written a slice at a time
        columnar.write_frame(manifest_path, table, meta)
        result.manifest_changed = True
    else:  # a file of unknown content (of another layout or damaged): compared row for row
        result.manifest_changed = write_manifest(manifest_path, columnar.to_arrow(table, meta))
    write_reports(result, report_json=report_json, report_html=report_html)
    if result.errors:
        # A failed Snakemake job loses its outputs: keep copies it does not know about,
        # so the reports stay readable and the next run still skips unchanged files.
        for src in (manifest_path, report_json, report_html):
            shutil.copyfile(src, kept_copy(src))
    else:
        for src in (manifest_path, report_json, report_html):
            kept_copy(src).unlink(missing_ok=True)


def print_summary(
    result: ValidationResult,
    console: Console | None = None,
    *,
    report: Path | None = None,
    max_errors: int = 50,
) -> None:
    """Print each error, the report's path, then the counts per reason as a table (printed last).

    Paths and messages hold user text (file names, metadata rows): escaped, so
    square brackets print as written instead of being read as rich markup.
    """
    console = console or Console(stderr=True)
    errors = [i for i in result.issues if i.action == "error"]
    for issue in errors[:max_errors]:  # in the log too: a failed Snakemake job loses its outputs
        line = f"[red]{issue.reason}[/red] {escape(issue.path)}: {escape(issue.message)}"
        console.print(line, highlight=False, soft_wrap=True)  # one line per error: greppable logs
    if len(errors) > max_errors:
        console.print(f"... and {len(errors) - max_errors} more error(s)")
    if report:
        console.print(f"validate: report {escape(str(report))}", highlight=False, soft_wrap=True)
    table = Table(title="Dataset validation")
    table.add_column("reason")
    table.add_column("action")
    table.add_column("files", justify="right")
    for reason, count in result.counts.items():
        action = result.actions.get(reason) or REASONS[reason][0]
        style = {"error": "red", "skip": "yellow"}.get(action, "")
        table.add_row(reason, f"[{style}]{action}[/]" if style else action, str(count))
    table.add_section()
    for label, value in (
        ("kept", result.kept),
        ("skipped", result.skipped),
        ("items", result.items),
        ("errors", result.errors),
        ("warnings", result.warnings),
    ):
        table.add_row(label, "", str(value))
    console.print(table)
    if result.errors:
        console.print(f"[red]{result.errors} error(s): fix them before training (each is listed in the report).[/red]")
    else:
        console.print(f"validate: {result.kept} of {result.items} items kept")
