"""``train.profile``: record a window of training steps with the torch profiler.

Writes under ``train/profile/``: the trace in the TensorBoard plugin's format
(``trace/*.pt.trace.json``, from ``torch.profiler.tensorboard_trace_handler``;
``tensorboard --logdir train/profile/trace`` with torch-tb-profiler, or open
the JSON in Perfetto / chrome://tracing) and a per-operator summary of the
window: ``ops.txt`` (torch's table) and ``ops.csv`` (the top operators by self
time, with calls and FLOPs where torch counts them).
"""

from __future__ import annotations

import csv
import io
import warnings
from pathlib import Path

import torch

from diffpipe.config import ProfileConfig
from diffpipe.utils import write_text_atomic

TOP_OPS = 30


class StepProfiler:
    """Call ``step()`` after every optimizer step and ``close()`` at the end; a no-op when not configured."""

    def __init__(self, cfg: ProfileConfig, out_dir: Path, *, enabled: bool = True, rank: int = 0):
        self._prof = None
        self.out_dir = out_dir
        if not cfg.steps or not enabled:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # One warm-up step inside the skipped ones (the profiler's own start-up cost), then the window.
        schedule = torch.profiler.schedule(skip_first=max(cfg.skip - 1, 0), wait=0, warmup=min(cfg.skip, 1),
                                           active=cfg.steps, repeat=1)
        trace = torch.profiler.tensorboard_trace_handler(str(out_dir / "trace"), worker_name=f"rank{rank}")

        def ready(prof) -> None:
            trace(prof)
            self._summarise(prof)

        with warnings.catch_warnings():  # "won't be using warmup" when skip is 0
            warnings.simplefilter("ignore", UserWarning)
            self._prof = torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=ready,
                                                record_shapes=True, with_flops=True)
        self._prof.start()

    def step(self) -> None:
        if self._prof is not None:
            self._prof.step()

    def close(self) -> None:
        if self._prof is not None:
            self._prof.stop()
            self._prof = None

    def _summarise(self, prof) -> None:
        device = torch.cuda.is_available()
        sort = "self_device_time_total" if device else "self_cpu_time_total"
        averages = prof.key_averages()
        write_text_atomic(self.out_dir / "ops.txt", averages.table(sort_by=sort, row_limit=TOP_OPS) + "\n")
        rows = sorted(averages, key=lambda e: _self_device_us(e) if device else e.self_cpu_time_total,
                      reverse=True)[:TOP_OPS]
        buf = io.StringIO()
        out = csv.writer(buf)
        out.writerow(["op", "calls", "self_cpu_us", "cpu_total_us", "self_device_us", "flops"])
        for e in rows:
            out.writerow([e.key, e.count, f"{e.self_cpu_time_total:.1f}", f"{e.cpu_time_total:.1f}",
                          f"{_self_device_us(e):.1f}", int(getattr(e, "flops", 0) or 0)])
        write_text_atomic(self.out_dir / "ops.csv", buf.getvalue())


def _self_device_us(event) -> float:
    """Self time on the accelerator (torch renamed ``self_cuda_time_total`` to ``self_device_time_total``)."""
    return float(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)) or 0.0)
