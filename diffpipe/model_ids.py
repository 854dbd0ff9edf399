"""How a Hugging Face id is written, told apart from a local path (no network, no cache).

``org/name`` is a model id and ``org/name/file.safetensors`` a file of one, unless a local file or folder
of that name exists: a path on disk always wins. :mod:`diffpipe.hub` resolves the ids; the config's
folder checks use these to leave ids out.
"""

from __future__ import annotations

import re
from pathlib import Path

_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
REPO_ID = re.compile(rf"^{_NAME}/{_NAME}$")
_REPO_FILE = re.compile(rf"^({_NAME}/{_NAME})/(.+)$")

__all__ = ["REPO_ID", "is_model_id", "split_file_id"]


def _local(value: str, base: Path | None) -> bool:
    path = Path(value).expanduser()
    return (path if path.is_absolute() or base is None else base / path).exists()


def is_model_id(value: str, base: Path | None = None) -> bool:
    """``org/name`` that is not an existing local file or folder."""
    return bool(REPO_ID.match(value)) and not _local(value, base)


def split_file_id(value: str, base: Path | None = None) -> tuple[str, str] | None:
    """``org/name/file.safetensors`` -> ``(org/name, file.safetensors)``; None for a local file."""
    match = _REPO_FILE.match(value)
    if not match or _local(value, base):
        return None
    return match.group(1), match.group(2)
