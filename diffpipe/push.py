"""``diffpipe push``: upload a run's verified export and its model card to a Hugging Face Hub repository.

What goes up is what the export's verify step read and passed (``verify.json``: the diffusers, PEFT,
ComfyUI and kohya files) and the model card written for the Hub (``README.hub.md``, which lists only
those files) as the repository's ``README.md``; a run whose export failed verification, or was never
exported, is refused. The merged folder (a whole pipeline) and the run's sample images stay local. One commit holds every file; a push of unchanged files makes no commit (the Hub compares
hashes). The endpoint is ``HF_ENDPOINT`` (default: the Hub); the token is ``huggingface_hub``'s own
(``HF_TOKEN`` or the ``hf auth login`` cache): diffpipe never reads, prints or writes it.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from diffpipe.hub import offline
from diffpipe.paths import EXPORT_CARD, EXPORT_HUB_CARD

VERIFY_NAME = "verify.json"  # export.verify.VERIFY_NAME, restated: importing it loads torch (start-up time)
#: export.card.LOCAL_ONLY, restated (same reason): verified, listed in verify.json, never uploaded.
LOCAL_ONLY = frozenset({"merged"})


@dataclass(frozen=True)
class PushResult:
    repo_url: str
    commit_url: str
    #: Paths in the repository, in upload order.
    files: list[str]

    def __str__(self) -> str:
        return f"{len(self.files)} files to {self.repo_url} ({self.commit_url})"


def pushed_files(export_dir: Path) -> list[Path]:
    """The files and folders to upload: those the verify step passed but the merged folder, then the Hub's card.

    Raises ValueError (naming the folder and what to run) when the export is missing or failed."""
    report_path = export_dir / VERIFY_NAME
    if not report_path.is_file():
        raise ValueError(f"{report_path} is missing: export (and verify) the run first with `diffpipe export`")
    report = json.loads(report_path.read_text())
    if not report.get("ok"):
        bad = [name for name, entry in report.get("files", {}).items() if not entry.get("ok")]
        raise ValueError(f"{report_path}: the export failed verification ({', '.join(bad)}); fix and re-export "
                         "before pushing")
    paths = [export_dir / name for name, entry in report.get("files", {}).items()
             if entry.get("format") not in LOCAL_ONLY] + [export_dir / EXPORT_HUB_CARD]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise ValueError(f"exported files missing: {', '.join(missing)}; re-run `diffpipe export`")
    return paths


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The errors of a server that cannot be reached (huggingface_hub's HTTP client's, and the OS's)."""
    found: list[type[BaseException]] = [OSError]
    for name in ("httpx2", "httpx"):  # the client huggingface_hub ships with (renamed in its 2.x)
        try:
            found.append(importlib.import_module(name).TransportError)
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def _in_repo(file: Path, export_dir: Path) -> str:
    """``file``'s path in the repository: the Hub's card is the repository's README.md."""
    name = file.relative_to(export_dir).as_posix()
    return EXPORT_CARD if name == EXPORT_HUB_CARD else name


def _operations(paths: list[Path], export_dir: Path) -> list:
    from huggingface_hub import CommitOperationAdd  # deferred: start-up time of every other command

    ops = []
    for path in paths:
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        ops += [CommitOperationAdd(path_in_repo=_in_repo(f, export_dir), path_or_fileobj=str(f)) for f in files]
    return ops


def push_export(export_dir: str | Path, repo_id: str, *, private: bool = False, revision: str | None = None,
                endpoint: str | None = None) -> PushResult:
    """Upload ``export_dir``'s verified files and model card to ``repo_id`` (created if absent, ``private``
    then) in one commit on ``revision`` (a branch, created from main if absent; default: main).

    ``endpoint``: the Hub's address (default: ``HF_ENDPOINT``, else the public Hub)."""
    from huggingface_hub import HfApi  # deferred: start-up time of every other command
    from huggingface_hub.errors import HfHubHTTPError

    if offline():
        raise ValueError("HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set: push needs the network; unset it")
    export_dir = Path(export_dir)
    paths = pushed_files(export_dir)
    # Read here, not at huggingface_hub's import: the variable may be set after it (tests, notebooks).
    api = HfApi(endpoint=endpoint or os.environ.get("HF_ENDPOINT") or None)
    ops = _operations(paths, export_dir)
    try:
        repo = api.create_repo(repo_id, private=private, exist_ok=True)
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.create_commit(repo_id, ops, commit_message=f"diffpipe push: {', '.join(p.name for p in paths)}",
                                 revision=revision)
    except HfHubHTTPError as err:  # the server's message (never the request's headers, so never the token)
        raise ValueError(f"push to {repo_id} at {api.endpoint} failed: {err}; check the repository name and that "
                         "your token (HF_TOKEN or `hf auth login`) may write there") from None
    except _transport_errors() as err:
        raise ValueError(f"push: cannot reach {api.endpoint} ({err}); check the network or HF_ENDPOINT") from None
    return PushResult(str(repo), info.commit_url, [op.path_in_repo for op in ops])
