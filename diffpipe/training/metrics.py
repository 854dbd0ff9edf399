"""Training metrics: one JSON line per optimizer step, the same scalars to the trackers."""

from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from diffpipe.training.trackers import Tracker, open_trackers, scalars


class MetricsWriter:
    """Appends to ``metrics.jsonl`` and logs to the trackers (``train.trackers``); a no-op on non-main ranks."""

    def __init__(self, jsonl: Path, tensorboard_dir: Path, *, enabled: bool = True, append: bool = False,
                 purge_step: int | None = None, trackers: list[str] = ("tensorboard",),
                 project: str = "diffpipe", run_name: str | None = None, config: dict[str, Any] | None = None):
        self.enabled = enabled
        self._file = None
        self._trackers: list[Tracker] = []
        if not enabled:
            return
        jsonl.parent.mkdir(parents=True, exist_ok=True)
        self._trackers = open_trackers(list(trackers), jsonl.parent, tensorboard_dir=tensorboard_dir,
                                       purge_step=purge_step, project=project, run_name=run_name, config=config)
        self._file = open(jsonl, "a" if append else "w")

    def log(self, step: int, *, jsonl: bool = True, **fields: Any) -> None:
        """One row of ``metrics.jsonl`` per step (``jsonl=False``: the trackers only)."""
        if not self.enabled:
            return
        if jsonl:
            self._file.write(json.dumps({"step": step, **fields}) + "\n")
            self._file.flush()
        values = scalars(fields)
        for tracker in self._trackers:
            tracker.log(step, values)

    def image(self, tag: str, image: Image.Image, step: int) -> None:
        """A PIL image into every tracker (e.g. the samples rendered during training)."""
        for tracker in self._trackers:
            tracker.image(tag, image, step)

    def close(self) -> None:
        if self._file:
            self._file.close()
        for tracker in self._trackers:
            tracker.close()


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process in MiB: CUDA allocator peak on GPU, max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def read_metrics(jsonl: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(jsonl).read_text().splitlines() if line.strip()]
