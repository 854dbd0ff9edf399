"""Where a run came from: its data, its base model, the code, and every file it exported.

The dataset digest is taken over what the items are (media and caption SHA-256 from the
validation manifest), not over file names or times; the base model's weight fingerprint is the
one export wrote into each file's header; each exported file is hashed as it is now.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diffpipe
from diffpipe.paths import EXPORT_CARD, FORMATS, LOW_NOISE_SUFFIX, REPO_ROOT, RunPaths, export_name
from diffpipe.utils import sha256_file, stable_json

#: The manifest columns that say what an item is (its media, caption, mask and control contents).
_ITEM_COLUMNS = ("id", "sha256", "caption_sha256", "mask_sha256", "control_sha256", "split", "status")


def dataset_digest(manifest: Path) -> dict[str, Any]:
    """SHA-256 over every kept item's id and content hashes, in id order, and the item count."""
    if not manifest.is_file():
        return {}
    # deferred: pyarrow costs start-up time, and only this reader needs it
    import pyarrow.parquet as pq

    names = set(pq.read_schema(manifest).names)
    table = pq.read_table(manifest, columns=[c for c in _ITEM_COLUMNS if c in names]).to_pylist()
    kept = sorted((r for r in table if r.get("status", "ok") in ("ok", "warning")), key=lambda r: r["id"])
    h = hashlib.sha256()
    for row in kept:
        h.update((stable_json(row) + "\n").encode())
    return {"sha256": h.hexdigest(), "items": len(kept), "of": len(table)}


def code_version() -> dict[str, str]:
    """diffpipe's version, and the git commit of this checkout (``+ local changes`` when it has some)."""
    out = {"version": diffpipe.__version__, "commit": "unknown (not a git checkout)"}
    if not (REPO_ROOT / ".git").exists():
        return out
    try:
        head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return out
    out["commit"] = head + (" + local changes" if dirty else "")
    return out


@dataclass(frozen=True)
class ExportedFile:
    """One exported file: its format (``card`` for the model card), path in the run, size and SHA-256."""

    fmt: str
    rel: str
    size: int
    sha256: str
    #: The export-name suffix of the trained part it holds ("_low_noise"), "" otherwise.
    suffix: str = ""


def exported_files(paths: RunPaths) -> list[ExportedFile]:
    """Every file of every export format (the files inside a folder format too), and the model card."""
    out = []
    for fmt in FORMATS:
        for suffix in ("", LOW_NOISE_SUFFIX):
            target = paths.export_file(fmt, suffix)
            files = sorted(p for p in target.rglob("*") if p.is_file()) if target.is_dir() else [target]
            for f in files:
                if f.is_file() and not f.name.startswith("."):
                    out.append(ExportedFile(fmt, f.relative_to(paths.root).as_posix(), f.stat().st_size,
                                            sha256_file(f), suffix))
    card = paths.export_dir / EXPORT_CARD
    if card.is_file():
        out.append(ExportedFile("card", card.relative_to(paths.root).as_posix(), card.stat().st_size,
                                sha256_file(card)))
    return out


def export_header(paths: RunPaths) -> dict[str, Any]:
    """The ``diffpipe.*`` facts export wrote into the first exported safetensors file that has them."""
    # deferred: safetensors (with torch) is needed only here
    from safetensors import safe_open

    for fmt in ("diffusers", "peft", "comfyui", "kohya"):
        f = paths.export_file(fmt)
        f = f / "adapter_model.safetensors" if f.is_dir() else f
        if not f.is_file():
            continue
        try:
            with safe_open(str(f), framework="pt") as st:
                meta = st.metadata() or {}
        except Exception:  # noqa: BLE001 - a damaged file: the next format may still say it
            continue
        facts = {}
        for key in ("base_model", "lora", "training", "dataset"):
            try:
                facts[key] = json.loads(meta.get(f"diffpipe.{key}", "{}"))
            except ValueError:
                facts[key] = {}
        if facts["base_model"]:
            return facts
    return {}


def how_to_load(file: ExportedFile, family: str | None, pipeline: str) -> str:
    """The model card's "how to load" line for ``file``'s format (Markdown, ``{path}`` filled in)."""
    if file.fmt == "card":
        return "the model card (Markdown): base model, settings, files"
    if family is None:
        return ""
    # deferred: the families' specs import diffusers
    from diffpipe.export.card import how_to_load as card_line

    name = export_name(file.fmt, file.suffix)
    path = f"export/{name}"
    try:
        line = card_line(file.fmt, family)
    except ValueError:  # a family this diffpipe does not know
        return ""
    return line.format(path=path, stem=Path(name).stem, pipeline=pipeline, load_args="")

