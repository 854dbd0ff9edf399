"""``datasets[].hub``: a Hugging Face dataset id resolved to a snapshot folder in the hub cache.

``huggingface_hub.snapshot_download`` downloads once (with its progress bars)
and afterwards answers from the cache. Offline mode (``HF_HUB_OFFLINE=1``, read
when the dataset is resolved, not when the library was imported) only looks in
the cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``).
The snapshot is then read like a local ``path``: a table layout
(:mod:`diffpipe.data.dataset.tables`) or a folder of files. Row identities come from the
media bytes, so a new revision with the same rows re-encodes nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

_TRUE = {"1", "on", "yes", "true"}


class HubError(ValueError):
    """A dataset id that cannot be resolved (the sentence names the id and the cache folder)."""


def cache_folder() -> Path:
    """The hub cache folder the current environment points at."""
    if cache := os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(cache).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) asks for the cache only."""
    return any(os.environ.get(k, "").strip().lower() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def resolve(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot folder of dataset ``repo_id`` at ``revision`` (default: ``main``).

    Raises:
        HubError: offline and not in the cache, or the hub refused (naming the id and cache folder).
    """
    try:  # deferred: huggingface_hub's download API takes ~0.6 s to import; only datasets[].hub needs it
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a dependency of diffusers
        raise HubError("datasets[].hub needs the huggingface_hub package: pip install huggingface_hub") from None
    cache = cache_folder()
    where = f"dataset {repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        folder = snapshot_download(
            repo_id, repo_type="dataset", revision=revision, cache_dir=str(cache), local_files_only=offline()
        )
    except Exception as err:
        if offline():
            raise HubError(
                f"{where} is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE is set: download it once "
                f"online (unset HF_HUB_OFFLINE), or point HF_HUB_CACHE at a cache that holds it"
            ) from None
        raise HubError(f"{where} cannot be downloaded into {cache}: {type(err).__name__}: {err}") from None
    return Path(folder)
