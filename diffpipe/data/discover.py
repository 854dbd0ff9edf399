"""Find a dataset's media and caption files.

Snakemake calls :func:`dataset_files` while building its DAG (the validate
rule's inputs), so it walks with ``os.scandir`` (one syscall per folder, file
types from the directory entry) and never raises: unreadable folders,
broken links and hidden (dot) files are left out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from diffpipe.config import DatasetConfig, ValidationConfig


@dataclass(frozen=True)
class Listing:
    """Media and caption files of one dataset, as paths relative to its root (POSIX)."""

    root: Path
    media: list[str]
    captions: list[str]
    root_ok: bool


def _walk(root: str, exts: set[str], cap_ext: str) -> tuple[list[str], list[str]]:
    media: list[str] = []
    captions: list[str] = []
    seen_dirs: set[tuple[int, int]] = set()
    stack = [("", root)]
    while stack:
        rel, folder = stack.pop()
        try:
            st = os.stat(folder)
            # Followed directory links could loop; visit each real folder once.
            if (st.st_dev, st.st_ino) in seen_dirs:
                continue
            seen_dirs.add((st.st_dev, st.st_ino))
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            name = entry.name
            if name.startswith("."):  # hidden files, .DS_Store, editor swap files
                continue
            sub = f"{rel}{name}"
            try:
                if entry.is_dir():
                    stack.append((sub + "/", entry.path))
                    continue
                is_file = entry.is_file()
            except OSError:
                continue
            if not is_file:
                continue
            ext = os.path.splitext(name)[1].lower()
            if ext in exts:
                media.append(sub)
            elif ext == cap_ext:
                captions.append(sub)
    return sorted(media), sorted(captions)


def list_dataset(ds: DatasetConfig, vcfg: ValidationConfig) -> Listing:
    """Media and caption files of ``ds`` (recursive, sorted, hidden files skipped)."""
    root = Path(ds.path).absolute()
    exts = {e.lower() if e.startswith(".") else f".{e.lower()}" for e in vcfg.image_exts}
    cap_ext = ds.caption_ext.lower()
    if not cap_ext.startswith("."):
        cap_ext = f".{cap_ext}"
    if not root.is_dir():
        return Listing(root, [], [], False)
    media, captions = _walk(str(root), exts, cap_ext)
    return Listing(root, media, captions, True)


def dataset_files(ds: DatasetConfig, vcfg: ValidationConfig) -> list[Path]:
    """Every media and caption file of a dataset (absolute, recursive, sorted)."""
    listing = list_dataset(ds, vcfg)
    return sorted(listing.root / rel for rel in listing.media + listing.captions)
