"""Full training checkpoints: written atomically, kept to the last K, resumed exactly.

A checkpoint is a folder ``train/checkpoints/step-NNNNNN`` holding

- DeepSpeed's own state (trainable weights, optimizer, LR scheduler; the
  frozen base weights are left out),
- ``rng-rankNNN.pt``: every random-number state of each rank,
- ``adapter/``: the LoRA as a PEFT adapter folder (what ``diffpipe export
  --checkpoint`` reads, see ``adapter_from_checkpoint``),
- ``diffpipe.json``: step, data position, world size, the resolved config and
  the digest of the training items, written last.

Every rank writes into ``.tmp-step-NNNNNN``; rank 0 renames it to its final
name only after all ranks are done, so a process killed while writing leaves
a ``.tmp-*`` folder that nothing reads (and the next save removes), never a
half-written checkpoint (SimpleTuner #2613).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffpipe.config import ConfigError
from diffpipe.training.adapter import load_adapter
from diffpipe.utils import atomic_path, write_text_atomic

META_NAME = "diffpipe.json"
ADAPTER_NAME = "adapter"
SAVE_REQUEST = "save"  # an empty file of this name in train/ asks for a checkpoint
_PREFIX = "step-"
_TMP = ".tmp-"

# Config keys a resume may change: they do not alter what the checkpoint means.
RESUME_SAFE_KEYS = (
    "output_dir",
    "validation",
    "export",
    "sample",
    "datasets.*.path",
    "train.checkpoint_every_steps",
    "train.checkpoint_every_minutes",
    "train.keep_checkpoints",
    "train.save_every_epochs",
    "train.eval",
    "train.sample_every_steps",
    "train.sample_every_epochs",
)


class ResumeError(ConfigError):
    """A checkpoint cannot be continued with this config or process count."""


def checkpoint_name(step: int) -> str:
    return f"{_PREFIX}{step:06d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (temporary folders excluded)."""
    root = Path(root)
    found = [p for p in root.glob(f"{_PREFIX}*") if (p / META_NAME).is_file()]
    return sorted(found, key=lambda p: int(p.name.removeprefix(_PREFIX)))


def resolve_checkpoint(root: str | Path, name: str | None = None) -> Path:
    """The checkpoint to resume: the latest under ``root``, or ``name`` (a folder name or path)."""
    root = Path(root)
    if name:
        path = Path(name) if Path(name).is_absolute() or os.sep in name else root / name
        if not (path / META_NAME).is_file():
            have = ", ".join(p.name for p in list_checkpoints(root)) or "none"
            raise FileNotFoundError(f"no complete checkpoint at {path} (complete ones under {root}: {have})")
        return path
    found = list_checkpoints(root)
    if not found:
        raise FileNotFoundError(f"no checkpoint to resume under {root}; train without --resume first")
    return found[-1]


def read_meta(ckpt: str | Path) -> dict[str, Any]:
    return json.loads((Path(ckpt) / META_NAME).read_text())


# -- random-number state ------------------------------------------------------------
def rng_state(generator: torch.Generator) -> dict[str, Any]:
    """Every RNG a step draws from: the noise generator, torch (LoRA dropout), Python, NumPy."""
    state = {
        "generator": generator.get_state(),
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(generator: torch.Generator, state: dict[str, Any]) -> None:
    generator.set_state(state["generator"])
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- save ------------------------------------------------------------------------------
def save_checkpoint(
    engine: Any,
    root: str | Path,
    *,
    step: int,
    rank: int,
    meta: dict[str, Any],
    rng: dict[str, Any],
    write_adapter: Callable[[Path], None],
    keep_last: int = 0,
) -> Path:
    """Write checkpoint ``step-<step>`` atomically (collective: every rank calls it).

    ``write_adapter(folder)`` is called on every rank (ZeRO-3 gathers the
    weights collectively) and writes the adapter on rank 0. ``keep_last > 0``
    then removes all but the newest ``keep_last`` checkpoints.
    """
    root = Path(root)
    name = checkpoint_name(step)
    tmp_tag = _TMP + name
    tmp = root / tmp_tag
    if rank == 0:
        for stale in root.glob(f"{_TMP}*"):  # left by a killed run
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    engine.save_checkpoint(str(root), tag=tmp_tag, client_state={"step": step}, save_latest=False,
                           exclude_frozen_parameters=True)
    torch.save(rng, tmp / f"rng-rank{rank:03d}.pt")
    write_adapter(tmp / ADAPTER_NAME)
    fault_point("checkpoint-write", step)
    _barrier()
    final = root / name
    if rank == 0:
        write_text_atomic(tmp / META_NAME, json.dumps({**meta, "step": step}, indent=1, sort_keys=True))
        if final.exists():  # a newer run over an older resume point: replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        if keep_last > 0:
            for old in list_checkpoints(root)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


# -- resume ----------------------------------------------------------------------------
def load_checkpoint(engine: Any, ckpt: Path, *, rank: int) -> dict[str, Any]:
    """Load DeepSpeed's state into ``engine``; return this rank's RNG state."""
    path, _ = engine.load_checkpoint(str(ckpt.parent), tag=ckpt.name, load_module_strict=False)
    if path is None:
        raise ResumeError(f"DeepSpeed could not load the checkpoint {ckpt}")
    return torch.load(ckpt / f"rng-rank{rank:03d}.pt", weights_only=False)


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        out = {f"{prefix}length": len(value)}
        for i, v in enumerate(value):
            out.update(_flatten(v, f"{prefix}{i}."))
        return out
    return {prefix.rstrip("."): value}


def _safe(key: str) -> bool:
    parts = key.split(".")
    for pattern in RESUME_SAFE_KEYS:
        pat = pattern.split(".")
        if len(parts) >= len(pat) and all(p in ("*", k) for p, k in zip(pat, parts, strict=False)):
            return True
    return False


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Dotted config keys whose values differ and that make a checkpoint meaningless."""
    a, b = _flatten(saved), _flatten(current)
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k, "<unset>") != b.get(k, "<unset>"))
    return [k for k in keys if not _safe(k)]


def check_resumable(meta: dict[str, Any], *, config: dict[str, Any], world_size: int, data_digest: str,
                    ckpt: Path) -> None:
    """Refuse, naming what differs, when the checkpoint does not fit this run."""
    problems = []
    saved_cfg = meta.get("config", {})
    a, b = _flatten(saved_cfg), _flatten(config)
    for key in config_differences(saved_cfg, config):
        problems.append(f"  {key}: checkpoint {a.get(key, '<unset>')!r}, config {b.get(key, '<unset>')!r}")
    if meta.get("world_size") != world_size:
        problems.append(f"  processes: checkpoint {meta.get('world_size')}, now {world_size}")
    if meta.get("data_digest") != data_digest:
        problems.append("  training data: the cached items differ from the checkpoint's (dataset edited?)")
    if problems:
        raise ResumeError(
            f"cannot resume from {ckpt}: it was made with a different setup:\n" + "\n".join(problems)
            + "\nRestore those settings, or start a new run (another output_dir, or train without --resume)."
        )


def truncate_metrics(jsonl: Path, step: int) -> None:
    """Drop metric rows after ``step`` (a killed run may have logged past its last checkpoint)."""
    if not jsonl.exists():
        return
    keep = [line for line in jsonl.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step]
    write_text_atomic(jsonl, "".join(line + "\n" for line in keep))


# -- export ----------------------------------------------------------------------------
def adapter_from_checkpoint(ckpt_dir: str | Path, out_adapter_dir: str | Path) -> Path:
    """Copy the LoRA of a training checkpoint out as a PEFT adapter folder.

    ``ckpt_dir`` is a checkpoint folder (``.../checkpoints/step-000100``) or a
    run's ``checkpoints`` folder (then its latest checkpoint is used). The
    result is what ``train/adapter`` holds, so every exporter reads it.
    """
    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / META_NAME).is_file() and list_checkpoints(ckpt_dir):
        ckpt_dir = list_checkpoints(ckpt_dir)[-1]
    src = ckpt_dir / ADAPTER_NAME
    if (ckpt_dir / META_NAME).is_file() and read_meta(ckpt_dir).get("config", {}).get("train", {}).get("mode") == "full":
        raise ValueError(f"{ckpt_dir} is a full fine-tune checkpoint: it holds no LoRA")
    if not (ckpt_dir / META_NAME).is_file() or not src.is_dir():
        raise FileNotFoundError(f"{ckpt_dir} is not a complete diffpipe checkpoint (no {META_NAME} or {ADAPTER_NAME}/)")
    load_adapter(src)  # fails early on a damaged adapter
    with atomic_path(out_adapter_dir, is_dir=True) as tmp:
        for f in src.iterdir():
            shutil.copy2(f, tmp / f.name)
    return Path(out_adapter_dir)


# -- helpers ---------------------------------------------------------------------------
def _barrier() -> None:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def fault_point(point: str, step: int) -> None:
    """Test hook: ``DIFFPIPE_FAULT=<point>:<step>`` kills the process here (e.g. mid-checkpoint)."""
    if os.environ.get("DIFFPIPE_FAULT") == f"{point}:{step}":
        os._exit(17)
