"""Small shared helpers: atomic writes, content hashing, stable JSON."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HASH_NAME = "sha256"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's content, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def stable_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace variance: equal data, equal text."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def digest(obj: Any) -> str:
    """Content hash of any JSON-serialisable value (used for cache keys)."""
    return sha256_bytes(stable_json(obj).encode())


@contextmanager
def atomic_path(target: str | os.PathLike, *, is_dir: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling path; rename it onto ``target`` only on success.

    A process killed inside the block leaves at most a ``.tmp-*`` sibling,
    never a half-written ``target``.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    inner = tmp / target.name
    if is_dir:
        inner.mkdir()
    try:
        yield inner
        if is_dir and target.exists():
            shutil.rmtree(target)
        os.replace(inner, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    write_bytes_atomic(path, text.encode())


def write_if_changed(path: str | os.PathLike, data: bytes | str) -> bool:
    """Atomically write ``data`` unless the file already holds exactly it.

    Returns True when the file was (re)written. Unchanged files keep their
    mtime, so Snakemake sees no update and downstream jobs do not rerun.
    """
    if isinstance(data, str):
        data = data.encode()
    path = Path(path)
    if path.exists() and path.read_bytes() == data:
        return False
    write_bytes_atomic(path, data)
    return True
