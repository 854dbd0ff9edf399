"""Models named by Hugging Face id: ``model.path: org/name`` and ``model.single_files: {vae: org/name/file}``.

Every place that reads a model goes through :func:`resolved`, which turns an id into the local
snapshot folder of the Hugging Face hub cache (``huggingface_hub``: ``HF_HUB_CACHE``, ``HF_HOME``,
a token from ``HF_TOKEN`` or ``huggingface-cli login`` for gated models). Online, the snapshot is
downloaded once (with the hub's progress bars) and later calls only check it; with
``HF_HUB_OFFLINE=1`` only the cache is read, and a model absent from it is a :class:`HubError`
naming the id and the cache folder.

Cache keys need no id: the family fingerprints the snapshot's configs and weight tensors exactly
as it does a local folder's, so another revision with other weights re-encodes and the same
weights under any revision do not.

A value is an id when no file or folder of that name exists (relative paths start at the working
folder, where every stage runs) and it has the hub's ``org/name`` shape. :func:`resolved` refuses, before any
load or download, a path that looks local (absolute, ``./``, ``../``, ``~``) and does not exist, a relative
name that is neither a folder nor an id, a file, and an empty folder (one that shadows an id says so);
:func:`check_local_model` (``diffpipe validate``, ``diffpipe run`` through :func:`prefetch`) also refuses a
folder without ``model_index.json`` or without a component folder that file lists.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from diffpipe.config import ConfigError
from diffpipe.model_ids import REPO_ID, is_model_id, split_file_id
from diffpipe.utils import read_json_object

if TYPE_CHECKING:
    from diffpipe.config import ModelConfig

_TRUE = {"1", "true", "yes", "on"}


class HubError(ConfigError):
    """A model id that cannot be resolved: the message names the id, the revision and the cache folder."""


def cache_dir() -> Path:
    """The hub cache folder, read from the environment at each call (as ``huggingface_hub`` reads it at import)."""
    if value := os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(value).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) forbids the network."""
    return any(os.environ.get(k, "").strip().lower() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _looks_local(value: str) -> bool:
    """Written as a path, never an id: absolute, ``./``, ``../`` or ``~``."""
    return value in (".", "..") or value.startswith(("./", "../", "~", ".\\", "..\\")) or Path(value).is_absolute()


def _absolute(value: str, base: Path | None) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else (base or Path.cwd()) / path


def local_model_folder(value: str, base: Path | None = None, *, key: str = "model.path") -> Path | None:
    """The existing, non-empty local folder ``model.path`` (``key``) names, or None for a Hugging Face id.

    A ConfigError naming the key and value for a local-looking path that does not exist, a name that is neither a
    folder nor an id (refused before any download), a file and an empty folder.
    """
    path = _absolute(value, base)
    if path.is_dir():
        if not any(path.iterdir()):
            shadow = (f"; it shadows the Hugging Face id {value}: remove the empty folder to use that model"
                      if REPO_ID.match(value) else "")
            raise ConfigError(f"{key} {value!r} is an empty folder ({path}): put a diffusers model there "
                              f"(model_index.json and its component folders){shadow}")
        return path
    if path.exists():
        raise ConfigError(f"{key} {value!r} is a file ({path}), not a diffusers model folder; a single-file "
                          "checkpoint goes in model.single_files, beside a model folder for the component configs")
    if _looks_local(value):  # the folder shown without `..` (the check itself used the path as written)
        raise ConfigError(f"{key} {value!r}: no such folder ({os.path.normpath(path)}); check the path")
    if not REPO_ID.match(value):
        raise ConfigError(f"{key} {value!r} is neither a folder here ({path}) nor a Hugging Face id "
                          "(org/name); check the path, or write the id as org/name")
    return None


def check_local_model(cfg: ModelConfig, base: Path | None = None) -> None:
    """Before any work: the local folder ``cfg.path`` names exists and is complete (an id is checked where it
    is resolved). A ConfigError names the value and what is missing."""
    if cfg.flavor == "local" and cfg.path and (folder := local_model_folder(cfg.path, base)) is not None:
        check_complete(folder, cfg.path)


def check_complete(folder: Path, value: str, *, key: str = "model.path") -> None:
    """``folder`` (``key``: ``value``) holds ``model_index.json`` and a non-empty folder for each component
    it lists."""
    index_file = folder / "model_index.json"
    if not index_file.is_file():
        raise ConfigError(f"{key} {value!r}: {folder} has no model_index.json, so it is not a complete "
                          "diffusers model folder (save one with the pipeline's save_pretrained, or download the "
                          "whole repository)")
    try:
        index = read_json_object(index_file)
    except ValueError as err:
        raise ConfigError(f"{key} {value!r}: {err}, so it is not a diffusers model index") from None
    listed = [name for name, entry in index.items() if not name.startswith("_") and isinstance(entry, list)
              and entry and entry[0] is not None]
    missing = sorted(n for n in listed if not (folder / n).is_dir() or not any((folder / n).iterdir()))
    if missing:
        raise ConfigError(f"{key} {value!r}: {folder} lacks the component folders {', '.join(missing)} "
                          "(listed in its model_index.json, absent or empty); download the complete model again")


def _missing(repo_id: str, what: str, revision: str | None, why: str) -> HubError:
    rev = f" at revision {revision!r}" if revision else ""
    # Quoted: the user pastes it into a shell.
    command = "huggingface-cli download " + shlex.quote(repo_id) + (
        f" --revision {shlex.quote(revision)}" if revision else "")
    fix = (f"unset HF_HUB_OFFLINE to download it, or download it where there is a network (`{command}`) into "
           "this cache"
           if offline() else "check the id, the revision and your network; for a gated model accept its licence "
           "on huggingface.co and log in (`huggingface-cli login`, or set HF_TOKEN)")
    return HubError(f"Hugging Face model {what}{rev}: {why} (hub cache {cache_dir()}); {fix}")


def _errors():
    # deferred: huggingface_hub's download API takes ~0.6 s to import; local-folder configs never need it
    from huggingface_hub import errors

    fatal = (errors.GatedRepoError, errors.RepositoryNotFoundError, errors.RevisionNotFoundError,
             errors.EntryNotFoundError)
    return fatal, errors.LocalEntryNotFoundError


def _fetch(download, what: str, *, online: bool = True, **kwargs) -> Path:
    """``download(**kwargs)`` online, else (or without a network) from the cache only; a HubError naming ``what``."""
    fatal, absent = _errors()
    repo_id, revision = kwargs["repo_id"], kwargs["revision"]
    if online and not offline():
        try:
            return Path(download(**kwargs))
        except absent:  # no network: use the cache if it holds the files
            pass
        except fatal as err:
            raise _missing(repo_id, what, revision, type(err).__name__) from None
        except OSError:
            pass
    try:
        return Path(download(**kwargs, local_files_only=True))
    except (absent, OSError):
        raise _missing(repo_id, what, revision, "not in the hub cache" + (" and offline" if offline() else
                                                                          " and not downloadable")) from None


#: Snapshots resolved online by this process: the hub is asked once per id, not once per component loaded.
_RESOLVED: dict[tuple[str, str | None, str | None, Path], Path] = {}


#: Files of a component folder a load never reads: other frameworks' weights, weight-file variants.
_UNREAD = re.compile(r"\.(msgpack|h5|onnx|onnx_data|ckpt|pb)$|\.(fp16|bf16|fp32|non_ema|ema)\.[^/]+$")


def download_files(index: dict, files: list[str], variant: str | None = None) -> list[str]:
    """The files of a repository (``files``) that loading its pipeline reads: ``model_index.json`` and the
    component folders it names, without the weight files no load reads (variants, other frameworks, ``.bin``
    where a folder has ``.safetensors``), and without files at the top (a repository's single-file copy)."""
    folders = {name for name, value in index.items() if not name.startswith("_") and isinstance(value, list)
               and value and value[0] is not None}
    def read(f: str) -> bool:  # with a weight variant, its weight files (and index) instead of the plain ones
        name = f.rsplit("/", 1)[1]
        weights = name.startswith(("diffusion_pytorch_model", "model")) and (".safetensors" in name or ".bin" in name)
        if variant is not None and weights:
            return re.search(rf"\.{re.escape(variant)}[.-]", name) is not None
        return not _UNREAD.search(f)

    kept = [f for f in files if f.split("/")[0] in folders and "/" in f and read(f)]
    safe = {f.rsplit("/", 1)[0] for f in kept if f.endswith(".safetensors")}
    return ["model_index.json"] + [f for f in kept if not (f.endswith(".bin") and f.rsplit("/", 1)[0] in safe)]


def snapshot(repo_id: str, revision: str | None = None, variant: str | None = None) -> Path:
    """The local snapshot folder of ``repo_id`` at ``revision`` (default ``main``), downloaded if needed.

    Online, only the files :func:`download_files` picks are fetched (FLUX.1-dev holds its transformer twice:
    as a folder and as one file at the top; SD 1.5 holds fp16, EMA and ``.bin`` copies).
    """
    # deferred: huggingface_hub's download API takes ~0.6 s to import; local-folder configs never need it
    from huggingface_hub import snapshot_download

    key = (repo_id, revision, variant, cache_dir())
    if key not in _RESOLVED or offline():
        wanted = None if offline() else _online_files(repo_id, revision, variant)
        _RESOLVED[key] = _fetch(snapshot_download, repr(repo_id), online=wanted is not None, repo_id=repo_id,
                                revision=revision, cache_dir=str(cache_dir()), allow_patterns=wanted)
    return _RESOLVED[key]


def _online_files(repo_id: str, revision: str | None, variant: str | None = None) -> list[str] | None:
    """:func:`download_files` for a repository, asking the hub for its file list (None: the hub did not answer)."""
    from huggingface_hub import HfApi  # deferred: ~0.6 s to import; only hub ids need it

    fatal, _ = _errors()
    try:
        files = HfApi().list_repo_files(repo_id, revision=revision)
    except fatal as err:  # gated without a token, no such repository or revision
        raise _missing(repo_id, repr(repo_id), revision, type(err).__name__) from None
    except Exception:  # noqa: BLE001 - no network (whichever HTTP client's error): read the cache
        return None
    index = json.loads(file(repo_id, "model_index.json", revision).read_text())
    return download_files(index, files, variant)


def file(repo_id: str, filename: str, revision: str | None = None) -> Path:
    """One file of ``repo_id`` from the hub cache, downloaded if needed."""
    from huggingface_hub import hf_hub_download  # deferred: ~0.6 s to import; only hub ids need it

    return _fetch(hf_hub_download, repr(f"{repo_id}/{filename}"), repo_id=repo_id, filename=filename,
                  revision=revision, cache_dir=str(cache_dir()))


def _not_here(value: str, base: Path | None, err: HubError) -> HubError:
    """An id's error that also says no local folder has that name (the user may have meant one)."""
    return HubError(f"no such folder in {base or Path.cwd()}, and as a Hugging Face id: {err}")


def model_index(path: str, revision: str | None = None, base: Path | None = None) -> Path:
    """``model_index.json`` of a local folder or an id (only that file is fetched for an id)."""
    if is_model_id(path, base):
        try:
            return file(path, "model_index.json", revision)
        except HubError as err:
            raise _not_here(path, base, err) from None
    folder = Path(path).expanduser()
    return (folder if folder.is_absolute() or base is None else base / folder) / "model_index.json"


def pipeline_class(index_file: Path) -> str | None:
    """The ``_class_name`` a ``model_index.json`` names (None when the file is absent)."""
    if not index_file.is_file():
        return None
    try:
        name = json.loads(index_file.read_text()).get("_class_name")
    except (ValueError, AttributeError) as err:
        raise ConfigError(f"{index_file}: not a diffusers model index ({err})") from None
    return name if isinstance(name, str) else None


def resolved(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with an id in ``path`` or ``single_files`` replaced by its local snapshot path.

    The written value stays readable as ``cfg.origin`` (export metadata names the id, not the cache).
    """
    update: dict = {}
    if cfg.flavor == "local" and cfg.path and local_model_folder(cfg.path) is None:
        try:
            update["path"] = str(snapshot(cfg.path, cfg.revision, cfg.weight_variant))
        except HubError as err:
            raise HubError(f"model.path {cfg.path!r}: {_not_here(cfg.path, None, err)}") from None
    files = {}
    for key, value in cfg.single_files.items():
        parts = split_file_id(value)
        files[key] = str(file(*parts)) if parts else value
    if files != cfg.single_files:
        update["single_files"] = files
    bases = [b.model_copy(update={"path": str(file(*parts))}) if (parts := split_file_id(b.path)) else b
             for b in cfg.base_loras]
    if bases != cfg.base_loras:
        update["base_loras"] = bases
    if not update:
        return cfg
    out = cfg.model_copy(update=update)
    out._origin = cfg.origin
    return out


def prefetch(cfg: ModelConfig) -> bool:
    """Resolve (download once) every id of ``cfg``; whether there was one.

    ``diffpipe run`` calls this before Snakemake starts and then runs the jobs with ``HF_HUB_OFFLINE=1``,
    so every job reads the same snapshot from the cache instead of asking the hub again. A local folder or
    a snapshot that lacks ``model_index.json`` or a component it lists is a ConfigError here, before any job.
    """
    check_local_model(cfg)
    out = resolved(cfg)
    if out is not cfg and out.path != cfg.path:
        check_complete(Path(out.path), cfg.path)
    return out is not cfg
