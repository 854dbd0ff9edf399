"""DeepSpeed in one place: process setup, config generation, engine, launcher.

The rest of the code sees ``setup_distributed``, ``build_engine`` and
``launch_local``. On a machine without CUDA the same code runs on CPU with
the gloo backend (bf16 and fp32 work there; fp16 needs a GPU).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

# deepspeed is imported inside the functions that use it: it takes seconds to import (about 9 s on 2 busy
# cores), and `diffpipe train`'s launcher and `diffpipe export` import this module without needing it.
from diffpipe.config import BF16_OPTIMIZERS, TrainConfig
from diffpipe.training.precision import check as check_precision
from diffpipe.training.precision import resolve_precision

# torch deprecates the collectives DeepSpeed calls; one warning per call floods the logs.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)

_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def load_deepspeed() -> ModuleType:
    """``deepspeed``, imported on first use (it takes seconds; only a process that trains or reads a DeepSpeed
    checkpoint pays it). Its autotuner imports MLflow whenever MLflow is installed, about 1 s of CPU in every
    training process for a feature diffpipe does not use; unless MLflow is already imported (an MLflow tracker),
    the first import runs with MLflow hidden, and MLflow stays importable afterwards."""
    _this_interpreters_ninja_first()
    hide = "deepspeed" not in sys.modules and "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # makes `import mlflow` fail in the autotuner
    try:
        import deepspeed  # deferred: seconds to import (see the docstring)
    finally:
        if hide and sys.modules.get("mlflow", False) is None:
            del sys.modules["mlflow"]
    return deepspeed


def _this_interpreters_ninja_first() -> None:
    """Put this interpreter's folder first on PATH when it holds a ``ninja``. DeepSpeed builds its CPU op with the
    first ``ninja`` on PATH, and ``diffpipe run``'s jobs find the one beside the interpreter; a ``diffpipe train``
    run from a shell without the venv activated would find the system's, and two ninja versions do not read each
    other's build log: each switch rebuilds the op (about 45 s of CPU, every DeepSpeed process waiting on its lock)."""
    folder = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if os.path.isfile(os.path.join(folder, "ninja")) and path.split(os.pathsep)[0] != folder:
        os.environ["PATH"] = f"{folder}{os.pathsep}{path}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_distributed() -> DistInfo:
    """Initialise torch.distributed through DeepSpeed (idempotent).

    A single process gets the rendezvous variables filled in, so ``diffpipe
    train`` needs no launcher; launched processes keep the ones they were given.
    """
    if "RANK" not in os.environ and not _rendezvous_from_slurm():
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
        )
    deepspeed = load_deepspeed()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend=backend)
    info = DistInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))
    if torch.cuda.is_available():
        torch.cuda.set_device(info.local_rank)
    return info


def _rendezvous_from_slurm() -> bool:
    """Inside ``srun`` with several tasks, take ranks and the master node from SLURM.

    So ``srun --nodes 2 --ntasks-per-node 4 diffpipe train -c CFG`` trains on 8
    GPUs with no launcher: rank = SLURM_PROCID, the first node of the job is the
    rendezvous host, the port is derived from the job id (same on every node).
    """
    env = os.environ
    if int(env.get("SLURM_NTASKS", "1")) <= 1 or "SLURM_PROCID" not in env or "SLURM_STEP_ID" not in env:
        return False
    nodelist = env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]
    master = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                            check=True).stdout.split()[0]
    env.update(
        MASTER_ADDR=master,
        MASTER_PORT=str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000),
        RANK=env["SLURM_PROCID"],
        WORLD_SIZE=env["SLURM_NTASKS"],
        LOCAL_RANK=env.get("SLURM_LOCALID", "0"),
    )
    return True


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def deepspeed_config(tc: TrainConfig, world_size: int) -> dict[str, Any]:
    """DeepSpeed's JSON config, generated from ours (users never write it)."""
    precision = resolve_precision(tc.precision)
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": tc.batch_size,
        "gradient_accumulation_steps": tc.grad_accum,
        "train_batch_size": tc.batch_size * tc.grad_accum * world_size,
        # optimizer_in_backward steps bf16 weights itself (the module is cast before the engine is built):
        # DeepSpeed's bf16 mode would wrap the optimizer with float32 master copies and gradients of its own.
        "bf16": {"enabled": precision == "bf16" and not tc.optimizer_in_backward},
        "fp16": {"enabled": precision == "fp16", "initial_scale_power": 16},
        "zero_optimization": _zero_config(tc),
        # Any torch optimizer (Adafactor, SGD, our bf16 AdamW) may run under ZeRO.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,  # we log ourselves
        "wall_clock_breakdown": False,
    }
    if tc.offload_optimizer or tc.offload_params:
        # Our torch optimizer steps on CPU-offloaded states too (no DeepSpeedCPUAdam build needed).
        cfg["zero_force_ds_cpu_optimizer"] = False
    # Always written: DeepSpeed's own default clips at 1.0, so leaving the key out for 0 would still clip.
    cfg["gradient_clipping"] = tc.grad_clip
    if tc.optimizer in BF16_OPTIMIZERS and not tc.optimizer_in_backward:
        # No fp32 master copy: the optimizer sees (and rounds into) the bf16 weights themselves.
        cfg["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    return cfg


def _zero_config(tc: TrainConfig) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": tc.zero_stage}
    if tc.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if tc.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return zero


def build_engine(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    tc: TrainConfig,
    world_size: int,
) -> Any:
    """Wrap model + torch optimizer (+ LR scheduler) in a DeepSpeed engine.

    A torch optimizer is handed over rather than DeepSpeed's fused ones, which
    compile for minutes on first use and do not exist on CPU.
    """
    check_precision(tc)
    deepspeed = load_deepspeed()
    if tc.optimizer_in_backward and world_size > 1:
        raise ValueError(f"train.optimizer_in_backward runs on one process (each parameter is stepped before its "
                         f"gradient could be averaged over the ranks); this run has {world_size}")
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=deepspeed_config(tc, world_size),
    )
    if tc.optimizer_in_backward:
        # Its gradient reduction would put back a zero gradient for every parameter the hooks freed.
        engine.enable_backward_allreduce = False
    return engine


def deepspeed_safe_types() -> list[type]:
    """The non-tensor types DeepSpeed's checkpoint files hold, all plain data (checked on ZeRO 0-3,
    offload, bf16 and pipeline checkpoints): ZeRO optimizer states pickle the loss scaler, the
    ZeRO stage enum and tensor-fragment addresses; fp16 (GPU) makes the loss scaler dynamic."""
    load_deepspeed()
    # deferred: deepspeed takes seconds to import; export reads checkpoints through this module
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


class _SafeLoads:
    """A DeepSpeed checkpoint engine whose ``load`` is ours; everything else is the wrapped one's."""

    def __init__(self, inner: Any, load: Callable[..., Any]):
        self._inner, self.load = inner, load

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextmanager
def safe_checkpoint_loads(model: Any, load: Callable[..., Any], allowed: list[type]) -> Iterator[None]:
    """Inside the block, every checkpoint file ``model.load_checkpoint`` reads goes through ``load``.

    DeepSpeed's own checkpoint engine unpickles with ``weights_only=False``
    (any pickle runs code). Every load of model, optimizer, ZeRO and pipeline
    layer states goes through ``model.checkpoint_engine``, swapped here for one
    that calls ``load``; the few ``torch.load`` calls DeepSpeed makes directly
    (universal checkpoints, which diffpipe does not write) are forced to
    ``weights_only=True`` by torch's own switch, with only ``allowed`` types.
    """
    inner = model.checkpoint_engine
    saved = {k: os.environ.pop(k, None) for k in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")}
    model.checkpoint_engine = _SafeLoads(inner, load)
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(allowed):
            yield
    finally:
        model.checkpoint_engine = inner
        os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
        os.environ.update({k: v for k, v in saved.items() if v is not None})


def offload_in_effect(model: Any) -> dict[str, bool]:
    """What the engine's ZeRO optimizer really offloads to CPU (read from DeepSpeed, not from our config).

    ZeRO-1/2 flag it as ``cpu_offload``, ZeRO-3 as ``offload_optimizer`` / ``offload_param``;
    without ZeRO there is no such optimizer and nothing is offloaded.
    """
    opt = getattr(model, "optimizer", None)
    return {
        "optimizer": bool(getattr(opt, "cpu_offload", False) or getattr(opt, "offload_optimizer", False)),
        "params": bool(getattr(opt, "offload_param", False)),
    }


@contextmanager
def gathered(params: list[torch.nn.Parameter], zero_stage: int) -> Iterator[None]:
    """Make ZeRO-3-partitioned ``params`` whole inside the block (collective; no-op below stage 3)."""
    if zero_stage < 3:
        yield
        return
    deepspeed = load_deepspeed()
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield


def broadcast_flag(flag: bool, world_size: int) -> bool:
    """Rank 0's decision, on every rank (so all ranks take a collective path together)."""
    if world_size == 1:
        return flag
    t = torch.tensor([int(flag)])
    torch.distributed.broadcast(t, src=0)
    return bool(t.item())


def any_over_ranks(flag: bool, world_size: int) -> bool:
    """True on every rank when ``flag`` is True on any (collective)."""
    if world_size == 1:
        return flag
    t = torch.tensor([int(flag)], device=device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


def all_gather_strings(value: str, world_size: int) -> list[str]:
    if world_size == 1:
        return [value]
    out: list[str] = [""] * world_size
    torch.distributed.all_gather_object(out, value)
    return out


def mean_over_ranks(value: torch.Tensor, world_size: int) -> float:
    if world_size > 1:
        value = value.clone()
        torch.distributed.all_reduce(value)
        value /= world_size
    return float(value)


def launch_local(processes: int, argv: list[str]) -> int:
    """Run ``python -m diffpipe <argv>`` as ``processes`` ranks on this machine.

    Each child gets the rendezvous variables; the first failing rank's exit
    code is returned and the others are stopped.
    """
    port = str(free_port())
    procs = []
    for rank in range(processes):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
                   WORLD_SIZE=str(processes), LOCAL_RANK=str(rank))
        procs.append(subprocess.Popen([sys.executable, "-m", "diffpipe", *argv], env=env))
    code = 0
    for p in procs:
        rc = p.wait()
        if rc and not code:
            code = rc
            for other in procs:
                if other.poll() is None:
                    other.terminate()
    return code


def in_launched_rank() -> bool:
    """True in a process some launcher started as one rank (ours, torchrun, or srun with tasks)."""
    under_srun = int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_STEP_ID" in os.environ
    return under_srun or all(k in os.environ for k in _DIST_ENV)
