"""When a training run saves a checkpoint, and which checkpoint it resumes from (after checking it fits the
config, the process count and the data)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from diffpipe.config import TrainConfig
from diffpipe.paths import RunPaths
from diffpipe.training import checkpoint as ckpt
from diffpipe.training import engine
from diffpipe.utils import write_text_atomic

METRICS_COPY = "metrics.jsonl"  # in each checkpoint: the run's metrics up to its step


class CheckpointTrigger:
    """Every N steps, every N minutes, or when a ``train/save`` request file appears."""

    def __init__(self, tc: TrainConfig, paths: RunPaths, world_size: int, is_main: bool):
        self.tc, self.world, self.is_main = tc, world_size, is_main
        self.request = paths.train_dir / ckpt.SAVE_REQUEST
        self.last = time.monotonic()

    def due(self, step: int) -> bool:
        if self.tc.checkpoint_every_steps and step % self.tc.checkpoint_every_steps == 0:
            return True
        minutes = self.tc.checkpoint_every_minutes
        # Time and files are seen by rank 0 only; every rank follows its decision.
        flag = self.is_main and (self.request.exists() or (minutes > 0 and time.monotonic() - self.last >= 60 * minutes))
        return engine.broadcast_flag(flag, self.world)

    def saved(self) -> None:
        self.last = time.monotonic()
        if self.is_main:
            self.request.unlink(missing_ok=True)


def newest(root: Path) -> Path | None:
    found = ckpt.list_checkpoints(root)
    return found[-1] if found else None


def check_resume(paths: RunPaths, run_meta: dict[str, Any], items: dict[str, dict[str, Any]],
                  name: str | None) -> Path:
    """The checkpoint to resume from, after checking it fits this config, process count and data."""
    path = ckpt.resolve_checkpoint(paths.checkpoints, name)
    ckpt.check_resumable(ckpt.read_meta(path), config=run_meta["config"], world_size=run_meta["world_size"],
                         data_digest=run_meta["data_digest"], ckpt=path, data_items=items)
    return path


def fitting_checkpoint(paths: RunPaths, run_meta: dict[str, Any], items: dict[str, dict[str, Any]],
                        log) -> Path | None:
    """The latest checkpoint when it fits this config, processes and data; else None, saying why.

    An interrupted workflow's train job reruns from scratch otherwise: the steps
    done are lost and the new checkpoints replace the ones it could resume from.
    """
    if not ckpt.list_checkpoints(paths.checkpoints):
        return None
    try:
        return check_resume(paths, run_meta, items, None)
    except (ckpt.ResumeError, ckpt.CheckpointError) as err:
        log(f"train: starting at step 1, not resuming: {err}")
        return None


def resume(model, gen: torch.Generator, paths: RunPaths, path: Path, rank: int, world_size: int) -> int:
    """Load the checkpoint's weights, optimizer, scheduler and RNG states; returns its step."""
    step = int(ckpt.read_meta(path)["step"])
    ckpt.set_rng_state(gen, ckpt.load_checkpoint(model, path, rank=rank, world_size=world_size))
    if rank == 0:
        if not paths.metrics.exists() and (path / METRICS_COPY).is_file():
            write_text_atomic(paths.metrics, (path / METRICS_COPY).read_text())
        ckpt.truncate_metrics(paths.metrics, step)
    return step
