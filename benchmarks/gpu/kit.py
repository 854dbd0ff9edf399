"""What every check of the GPU kit shares: where rows go, the clock, the device and the environment.

Rows are JSON lines appended to ``$OUT/results.jsonl`` and flushed to disk the moment a point
finishes, so a run stopped by its time limit keeps what it measured; ``log.txt`` beside it gets
the human-readable lines. Every row names its ``check`` (``env``, ``a``..``e``) and ``point`` and
has a ``status``: ``ok``, ``dry-run`` (the dry run's stand-in for a GPU figure), ``skipped`` (with
the ``reason``, e.g. a GPU-only piece in the dry run, or no time left), ``oom`` or ``error``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the repository
RESULTS, LOG = "results.jsonl", "log.txt"


@dataclass
class Run:
    """One run of the kit: the output folder, dry or real, and the wall-clock deadline."""

    out: Path
    dry: bool
    deadline: float  # time.time() after which no new point starts
    steps: int = 5  # measured steps per point (after warm-up)
    warmup: int = 2
    only: set[str] = field(default_factory=set)

    @property
    def left(self) -> float:
        return self.deadline - time.time()

    def row(self, check: str, point: str, status: str, **fields: Any) -> dict[str, Any]:
        """Append one row to results.jsonl (flushed and synced: a timeout keeps it) and log it."""
        row = {"check": check, "point": point, "status": status, **fields, "t": round(time.time(), 1)}
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.out / RESULTS, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.log(f"[{check}] {point}: {status} " + ", ".join(f"{k}={_short(v)}" for k, v in fields.items()))
        return row

    def log(self, line: str) -> None:
        print(line, flush=True)
        with open(self.out / LOG, "a") as f:
            f.write(line + "\n")

    def skip(self, check: str, point: str, reason: str) -> dict[str, Any]:
        return self.row(check, point, "skipped", reason=reason)


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    text = str(v)
    return text if len(text) <= 120 else text[:117] + "..."


def run_group(cmd: list[str], *, timeout: float, **kwargs: Any) -> tuple[int | str, str, str]:
    """Run ``cmd`` in its own process group; at ``timeout`` the whole group is killed (Snakemake's jobs,
    a worker's children). Returns (exit code or ``"timeout"``, stdout, stderr)."""
    import signal

    proc = subprocess.Popen(cmd, start_new_session=True, text=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out or "", err or ""
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return "timeout", out or "", err or ""


def read_rows(out: Path) -> list[dict[str, Any]]:
    file = out / RESULTS
    if not file.is_file():
        return []
    return [json.loads(line) for line in file.read_text().splitlines() if line.strip()]


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextmanager
def timed():
    """``with timed() as t: ...`` then ``t()`` is the seconds it took (the device synchronised at both ends)."""
    sync()
    start = time.perf_counter()
    box: list[float] = []
    yield lambda: box[0]
    sync()
    box.append(time.perf_counter() - start)


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def is_oom(err: BaseException) -> bool:
    return type(err).__name__ == "OutOfMemoryError" or isinstance(err, MemoryError)


def free_device_memory() -> None:
    import gc

    import torch

    torch._dynamo.reset()  # compiled blocks (check d) hold the model they were compiled from
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


PACKAGES = ["torch", "triton", "diffusers", "deepspeed", "peft", "transformers", "accelerate", "torchao", "zarr",
            "numcodecs", "snakemake", "pydantic", "typer", "safetensors", "pyarrow", "flash-attn", "flash_attn_3",
            "sageattention", "xformers", "kernels"]


def environment(dry: bool) -> dict[str, Any]:
    """GPU, driver, torch, CUDA, Python and package versions, and a bf16 matmul's rate on this device."""
    import torch

    env: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(),
                           "torch": torch.__version__, "cuda": torch.version.cuda,
                           "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                           "packages": {p: _version(p) for p in PACKAGES}}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            env["nvidia_smi"] = smi.stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as err:
            env["nvidia_smi"] = f"unavailable: {err}"
    env["matmul_bf16_tflops"] = matmul_tflops(dry)
    return env


def matmul_tflops(dry: bool) -> float:
    """Rate of a bf16 square matmul (8192 on CUDA, 256 on CPU), median of 10 after 3 warm-ups, on random data:
    the measured ceiling MFU is also reported against."""
    import torch

    n = 256 if dry or not torch.cuda.is_available() else 8192
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a, b = (torch.randn(n, n, device=dev, dtype=torch.bfloat16) for _ in range(2))
    times = []
    for i in range(13):
        with timed() as t:
            a @ b
        if i >= 3:
            times.append(t())
    return 2 * n**3 / statistics.median(times) / 1e12
