"""Dataset validation: fingerprint every file, flag problems, write the manifest.

Each media file becomes one manifest row with its content hash, size, caption
and status. Problems carry a stable reason code and an action: ``skip``
(left out of training and reported), ``warn`` (reported only) or ``error``
(the run stops). Nothing in a dataset is ever modified.

Incremental: a file whose size and mtime_ns match the previous manifest
reuses its hash and probe results without reading its content. Caption files
are small and are the most edited, so they are read on every run.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image
from rich.console import Console
from rich.table import Table

from diffpipe.config import DatasetConfig, ValidationConfig
from diffpipe.data.discover import Listing, list_dataset
from diffpipe.utils import atomic_path, digest

Action = Literal["skip", "warn", "error"]

#: Reason code -> action. Codes are stable: reports and tests match on them.
REASONS: dict[str, Action] = {
    "missing_caption": "skip",
    "empty_caption": "skip",
    "caption_not_utf8": "skip",
    "corrupt_media": "skip",
    "zero_byte": "skip",
    "too_small": "skip",
    "unreadable": "skip",
    "orphan_caption": "warn",
    "missing_dataset": "error",
    "no_media": "error",
}
#: Reasons found by reading media content, reused when size and mtime are unchanged.
_PROBE_REASONS = {"corrupt_media", "zero_byte"}

MANIFEST_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("dataset", pa.string()),
        ("path", pa.string()),
        ("relpath", pa.string()),
        ("sha256", pa.string()),
        ("size", pa.int64()),
        ("mtime_ns", pa.int64()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("frames", pa.int32()),
        ("caption", pa.string()),
        ("caption_sha256", pa.string()),
        ("status", pa.string()),
        ("reasons", pa.list_(pa.string())),
        ("notes", pa.list_(pa.string())),  # one human sentence per reason
    ]
)


@dataclass(frozen=True)
class Issue:
    """One flagged file (or dataset): where, which reason, and a sentence for humans."""

    dataset: str
    path: str
    reason: str
    message: str
    sha256: str | None = None

    @property
    def action(self) -> Action:
        return REASONS[self.reason]


@dataclass
class ValidationResult:
    """Counts of one validation run; ``errors > 0`` means the run must stop."""

    items: int = 0
    kept: int = 0
    skipped: int = 0
    errors: int = 0
    warnings: int = 0
    manifest_changed: bool = False
    hashed: int = 0  # media files whose content was read this run
    reused: int = 0  # media files whose hash came from the previous manifest
    issues: list[Issue] = field(default_factory=list)
    datasets: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def counts(self) -> dict[str, int]:
        return dict(sorted(Counter(i.reason for i in self.issues).items()))


def item_id(dataset: str, relpath: str) -> str:
    """Stable item id: a digest of the dataset name and the file's relative path."""
    return digest([dataset, relpath])[:16]


@dataclass
class _Probe:
    sha256: str | None
    width: int | None
    height: int | None
    reason: str | None = None
    note: str | None = None


def _probe(path: str) -> _Probe:
    """Hash the file and fully decode it (truncation only shows on a full load)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        return _Probe(
            None, None, None, "unreadable", f"cannot read the file: {err.strerror or err}"
        )
    sha = hashlib.sha256(data).hexdigest()
    if not data:
        return _Probe(sha, None, None, "zero_byte", "the file is empty (0 bytes)")
    try:
        with Image.open(io.BytesIO(data)) as img:
            w, h = img.size
            if img.format == "JPEG":
                # DCT-domain downscale still walks the whole stream (truncation is
                # caught) at a fraction of the decode cost.
                img.draft("RGB", (max(1, w // 8), max(1, h // 8)))
            img.load()
            orientation = img.getexif().get(0x0112, 1)
    except Exception as err:  # PIL raises OSError, SyntaxError, ValueError, bomb errors...
        return _Probe(sha, None, None, "corrupt_media", f"cannot decode the image: {err}")
    if orientation in (5, 6, 7, 8):  # what ImageOps.exif_transpose does to the size
        w, h = h, w
    return _Probe(sha, w, h)


def _read_caption(path: Path) -> tuple[str, str | None, str | None]:
    """Caption text, or ('', reason, note)."""
    try:
        data = path.read_bytes()
    except OSError as err:
        return "", "unreadable", f"cannot read caption file {path.name}: {err.strerror or err}"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        return (
            "",
            "caption_not_utf8",
            (
                f"caption file {path.name} is not valid UTF-8 (byte offset {err.start}); "
                "re-save it as UTF-8"
            ),
        )
    text = text.removeprefix("\ufeff").strip()  # editors add a BOM and trailing newline
    if not text:
        return "", "empty_caption", f"caption file {path.name} is empty or only whitespace"
    return text, None, None


def _load_previous(path: Path | None) -> dict[str, dict[str, Any]]:
    if path is None or not path.is_file():
        return {}
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception:  # a damaged previous manifest only costs the reuse
        return {}
    return {r["id"]: r for r in rows if r.get("sha256")}


def _scan_dataset(
    ds: DatasetConfig,
    listing: Listing,
    vcfg: ValidationConfig,
    previous: dict[str, dict[str, Any]],
    rehash: bool,
    pool: ThreadPoolExecutor,
    result: ValidationResult,
) -> list[dict[str, Any]]:
    cap_ext = (
        ds.caption_ext.lower() if ds.caption_ext.startswith(".") else f".{ds.caption_ext.lower()}"
    )
    captions = {os.path.splitext(c)[0]: c for c in listing.captions}
    media_stems = {os.path.splitext(m)[0] for m in listing.media}
    rows: list[dict[str, Any]] = []
    to_probe: list[int] = []
    for rel in listing.media:
        path = listing.root / rel
        rid = item_id(ds.name, rel)
        try:
            st = path.stat()
            size, mtime = st.st_size, st.st_mtime_ns
        except OSError:
            size, mtime = 0, 0
        row = {
            "id": rid,
            "dataset": ds.name,
            "path": str(path),
            "relpath": rel,
            "size": size,
            "mtime_ns": mtime,
            "frames": 1,
            "reasons": [],
            "notes": [],
        }
        prev = previous.get(rid)
        if prev and not rehash and prev["size"] == size and prev["mtime_ns"] == mtime:
            row.update(sha256=prev["sha256"], width=prev["width"], height=prev["height"])
            for reason, note in zip(prev["reasons"], prev["notes"], strict=True):
                if reason in _PROBE_REASONS:
                    row["reasons"].append(reason)
                    row["notes"].append(note)
            result.reused += 1
        else:
            to_probe.append(len(rows))
        rows.append(row)

    probes = pool.map(lambda i: _probe(rows[i]["path"]), to_probe)
    for i, probe in zip(to_probe, probes, strict=True):
        row = rows[i]
        row.update(sha256=probe.sha256, width=probe.width, height=probe.height)
        if probe.reason:
            row["reasons"].append(probe.reason)
            row["notes"].append(probe.note)
        result.hashed += 1

    for row in rows:
        stem = os.path.splitext(row["relpath"])[0]
        if stem in captions:
            caption, reason, note = _read_caption(listing.root / captions[stem])
        else:
            caption, reason = "", "missing_caption"
            note = f"no caption file {Path(stem).name}{cap_ext} next to it"
        if reason:
            row["reasons"].append(reason)
            row["notes"].append(note)
        w, h = row["width"], row["height"]
        if w is not None and h is not None and min(w, h) < vcfg.min_size:
            row["reasons"].append("too_small")
            row["notes"].append(
                f"image is {w}x{h}, smaller than validation.min_size={vcfg.min_size}"
            )
        row["caption"] = caption
        row["caption_sha256"] = hashlib.sha256(caption.encode()).hexdigest() if caption else None
        actions = {REASONS[r] for r in row["reasons"]}
        row["status"] = "skipped" if "skip" in actions else "warning" if actions else "ok"
        for reason, note in zip(row["reasons"], row["notes"], strict=True):
            result.issues.append(Issue(ds.name, row["path"], reason, note, row["sha256"]))

    for stem, rel in captions.items():
        if stem not in media_stems:
            result.issues.append(
                Issue(
                    ds.name,
                    str(listing.root / rel),
                    "orphan_caption",
                    f"caption file {Path(rel).name} has no image with the same name",
                )
            )
    return rows


def _write_manifest(path: Path, table: pa.Table) -> bool:
    """Write the manifest unless it holds the same rows; unchanged -> only touch it."""
    if path.is_file():
        try:
            same = pq.read_table(path).equals(table)
        except Exception:
            same = False
        if same:
            os.utime(path)  # newer than its inputs for Snakemake, same content for its consumers
            return False
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
    return True


def run_validation(
    datasets: list[DatasetConfig],
    vcfg: ValidationConfig,
    *,
    manifest_path: str | Path,
    report_json: str | Path,
    report_html: str | Path,
    previous: str | Path | Literal["auto"] | None = "auto",
    rehash: bool = False,
) -> ValidationResult:
    """Scan datasets, write the manifest and both reports, return the counts.

    Args:
        datasets: datasets to scan (names must be unique).
        vcfg: which extensions are media and the minimum image side.
        manifest_path: Parquet manifest (one row per media file, sorted by id).
        report_json: machine-readable report (counts per reason, flagged files).
        report_html: self-contained page with thumbnails of flagged images.
        previous: manifest whose hashes are reused for unchanged files;
            ``"auto"`` uses ``manifest_path`` if it exists, None disables reuse.
        rehash: read every file even when its size and mtime are unchanged.
    """
    from diffpipe.data.report import write_reports  # imported here: report imports this module

    manifest_path = Path(manifest_path)
    prev_path = manifest_path if previous == "auto" else (Path(previous) if previous else None)
    prev_rows = _load_previous(prev_path)
    result = ValidationResult()
    rows: list[dict[str, Any]] = []
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for ds in datasets:
            listing = list_dataset(ds, vcfg)
            if not listing.root_ok:
                result.issues.append(
                    Issue(
                        ds.name,
                        str(listing.root),
                        "missing_dataset",
                        f"dataset folder {listing.root} does not exist or is not a folder",
                    )
                )
                continue
            if not listing.media:
                exts = ", ".join(vcfg.image_exts)
                result.issues.append(
                    Issue(
                        ds.name,
                        str(listing.root),
                        "no_media",
                        f"dataset folder {listing.root} holds no media files ({exts})",
                    )
                )
            ds_rows = _scan_dataset(ds, listing, vcfg, prev_rows, rehash, pool, result)
            kept = sum(r["status"] != "skipped" for r in ds_rows)
            result.datasets[ds.name] = {
                "items": len(ds_rows),
                "kept": kept,
                "skipped": len(ds_rows) - kept,
            }
            rows.extend(ds_rows)

    rows.sort(key=lambda r: r["id"])
    result.items = len(rows)
    result.kept = sum(r["status"] != "skipped" for r in rows)
    result.skipped = result.items - result.kept
    result.errors = sum(i.action == "error" for i in result.issues)
    result.warnings = sum(i.action == "warn" for i in result.issues)
    result.issues.sort(key=lambda i: (i.dataset, i.path, i.reason))
    table = pa.Table.from_pylist(rows, schema=MANIFEST_SCHEMA)
    result.manifest_changed = _write_manifest(manifest_path, table)
    write_reports(result, report_json=Path(report_json), report_html=Path(report_html))
    return result


def print_summary(result: ValidationResult, console: Console | None = None) -> None:
    """Print the per-reason counts and totals as a rich table."""
    console = console or Console(stderr=True)
    table = Table(title="Dataset validation")
    table.add_column("reason")
    table.add_column("action")
    table.add_column("files", justify="right")
    for reason, count in result.counts.items():
        table.add_row(reason, REASONS[reason], str(count))
    table.add_section()
    table.add_row("kept", "", str(result.kept))
    table.add_row("skipped", "", str(result.skipped))
    table.add_row("items", "", str(result.items))
    console.print(table)
    if result.errors:
        console.print(
            f"[red]{result.errors} error(s): fix them before training (see the report).[/red]"
        )
