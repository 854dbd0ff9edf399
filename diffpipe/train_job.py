"""``diffpipe train`` as a process: the run folder's lock, the relaunch as local ranks, the teardown.

One trainer per run folder, and none beside a ``diffpipe run`` other than the run's own
train job (:mod:`diffpipe.runlock`). Rank 0 holds the lock for every rank (under srun or
torchrun); the ranks :func:`diffpipe.training.engine.launch_local` starts find it held by
their parent (:data:`diffpipe.runlock.HELD_ENV`). A rank of several closes its process group
before it exits.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as torch_dist

from diffpipe import memory_plan, runlock
from diffpipe.config import Config, ConfigError
from diffpipe.paths import RunPaths
from diffpipe.training import engine, trackers
from diffpipe.training.loop import train


@dataclass(frozen=True)
class TrainRequest:
    """What ``diffpipe train`` was asked: the config file (the launched ranks read it again) and the flags."""

    config_path: Path
    processes: int = 1
    resume: bool = False
    checkpoint: str | None = None
    auto_resume: bool = False

    def argv(self) -> list[str]:
        """The ``diffpipe`` arguments each launched rank runs (``--processes`` kept: a rank does not relaunch)."""
        argv = ["train", "--config", str(self.config_path), "--processes", str(self.processes)]
        argv += ["--resume"] if self.resume else []
        argv += ["--checkpoint", self.checkpoint] if self.checkpoint else []
        return argv + (["--auto-resume"] if self.auto_resume else [])


def run_train_job(cfg: Config, paths: RunPaths, request: TrainRequest, *, log: Callable[[str], None]) -> int:
    """Train under the run folder's lock; returns the exit code (the ranks' when it launched several)."""
    if problems := trackers.problems(cfg.train.trackers):  # before any model loads
        raise ConfigError("\n".join(problems))
    launched = engine.in_launched_rank()
    with _train_lock(paths, launched, log) as held:
        cfg, planned = _memory_plan(cfg, launched, log)  # before any model loads
        read_base_loras(cfg, paths, log)  # before local ranks start: they find the folders read
        if request.processes > 1 and not launched:
            os.environ[runlock.HELD_ENV] = runlock.held_env(held)  # the ranks run under this lock
            if planned is not None:  # one plan for every rank (their GPUs' free memory may differ)
                os.environ[PLAN_ENV] = json.dumps(planned)
            return engine.launch_local(request.processes, request.argv())
        train(cfg, paths, resume=request.resume, checkpoint=request.checkpoint, log=log,
              auto_resume=request.auto_resume, memory_plan=planned)
        if launched and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            _close_process_group()
    return 0


def read_base_loras(cfg: Config, paths: RunPaths, log: Callable[[str], None]) -> None:
    """``model.base_loras`` read into the run folder (:mod:`diffpipe.export.base_loras`), each checked."""
    if not cfg.model.base_loras:
        return
    # deferred: the family registry and the LoRA readers import torch and diffusers (start-up time)
    from diffpipe.export.base_loras import prepare_base_loras
    from diffpipe.families import get_family

    family = get_family(cfg.model)
    try:
        folders = prepare_base_loras(family.cfg, family, paths.root)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    log(f"train: base LoRAs read: {', '.join(f'{f.name} x{s:g}' for f, s in folders)}")


#: The plan the parent of local ranks made (``train.memory: auto``), as JSON, for its ranks to apply.
PLAN_ENV = "DIFFPIPE_MEMORY_PLAN"


def _memory_plan(cfg: Config, launched: bool, log: Callable[[str], None]) -> tuple[Config, dict | None]:
    """Under ``train.memory: auto``, the config with the planned settings for its unset memory keys, and the
    plan (the parent's, in a launched local rank); the config as it is under ``manual``."""
    if cfg.train.memory != "auto":
        return cfg, None
    if launched and PLAN_ENV in os.environ:
        planned = json.loads(os.environ[PLAN_ENV])
    else:
        plan = memory_plan.training_plan(cfg)
        for line in plan.lines():
            log(f"train: memory plan: {line}")
        planned = plan.as_dict()
    return memory_plan.apply_plan(cfg, planned), planned


@contextmanager
def _train_lock(paths: RunPaths, launched: bool, log: Callable[[str], None]) -> Iterator[Path | None]:
    """The train lock for rank 0 (or a lone process), checked free of a run; ``None`` for the other ranks."""
    rank = int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)
    lock = nullcontext() if launched and rank != 0 else runlock.hold(paths.root, runlock.TRAIN_LOCK,
                                                                     "diffpipe train", warn=log)
    with lock as held:
        if held is not None:
            runlock.check_free(paths.root, runlock.RUN_LOCK, "diffpipe run")
        yield held


def _close_process_group() -> None:
    # A rank of several: close the process group before exit, or gloo's threads may still run at
    # interpreter shutdown and abort the process ("terminate called without an active exception").
    if torch_dist.is_initialized():
        torch_dist.barrier()
        torch_dist.destroy_process_group()
