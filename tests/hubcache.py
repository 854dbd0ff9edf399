"""A Hugging Face hub cache folder built offline, in the hub's own layout.

``models--<org>--<name>/blobs/<sha256>`` holds each file once, named by its content;
``snapshots/<commit>/<path>`` are relative symbolic links to the blobs; ``refs/<branch>``
holds the commit a branch points at. ``huggingface_hub`` reads exactly this layout
(``snapshot_download(..., local_files_only=True)``, ``try_to_load_from_cache``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def add_snapshot(cache: Path, repo_id: str, folder: Path, commit: str, *, ref: str | None = "main") -> Path:
    """Lay ``folder`` out as snapshot ``commit`` of ``repo_id`` in ``cache`` (``ref`` points at it); its path."""
    assert len(commit) == 40
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap = repo / "snapshots" / commit
    for src in sorted(p for p in folder.rglob("*") if p.is_file()):
        blob = repo / "blobs" / hashlib.sha256(src.read_bytes()).hexdigest()
        if not blob.exists():
            shutil.copyfile(src, blob)
        link = snap / src.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snap
