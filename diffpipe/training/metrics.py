"""Training metrics: one JSON line per optimizer step, TensorBoard scalars, a loss plot."""

from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageDraw


class MetricsWriter:
    """Appends to ``metrics.jsonl`` and TensorBoard; a no-op on non-main ranks."""

    def __init__(self, jsonl: Path, tensorboard_dir: Path, *, enabled: bool = True, append: bool = False,
                 purge_step: int | None = None):
        self.enabled = enabled
        self._file = None
        self._tb = None
        if not enabled:
            return
        jsonl.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(jsonl, "a" if append else "w")
        from torch.utils.tensorboard import SummaryWriter

        # ``purge_step`` hides events a killed run logged past its resume point.
        self._tb = SummaryWriter(str(tensorboard_dir), purge_step=purge_step)

    def log(self, step: int, *, jsonl: bool = True, **scalars: Any) -> None:
        """One row of ``metrics.jsonl`` per step (``jsonl=False``: TensorBoard only)."""
        if not self.enabled:
            return
        if jsonl:
            self._file.write(json.dumps({"step": step, **scalars}) + "\n")
            self._file.flush()
        for name, value in scalars.items():
            if isinstance(value, int | float) and name != "epoch":
                tag = name.replace("eval_", "eval/", 1) if name.startswith("eval_") else f"train/{name}"
                self._tb.add_scalar(tag, value, step)

    def image(self, tag: str, image: Image.Image, step: int) -> None:
        """A PIL image into TensorBoard (e.g. the samples rendered during training)."""
        if self.enabled:
            import numpy as np

            self._tb.add_image(tag, np.asarray(image.convert("RGB")), step, dataformats="HWC")

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._tb.close()


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process in MiB: CUDA allocator peak on GPU, max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def read_metrics(jsonl: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(jsonl).read_text().splitlines() if line.strip()]


def plot_loss(rows: list[dict[str, Any]], out: Path, size: tuple[int, int] = (640, 360)) -> Path:
    """Draw loss per step (raw and smoothed) as a PNG: a quick look without TensorBoard."""
    w, h = size
    pad = 40
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    losses = [r["loss"] for r in rows if "loss" in r]
    draw.text((pad, 8), f"training loss ({len(losses)} steps)", fill="black")
    if len(losses) >= 2:
        lo, hi = min(losses), max(losses)
        span = (hi - lo) or 1.0

        def xy(i: int, v: float) -> tuple[float, float]:
            return (pad + i * (w - 2 * pad) / (len(losses) - 1), h - pad - (v - lo) * (h - 2 * pad) / span)

        draw.rectangle([pad, pad, w - pad, h - pad], outline="gray")
        draw.line([xy(i, v) for i, v in enumerate(losses)], fill=(160, 180, 230), width=1)
        smooth, ema = [], losses[0]
        for v in losses:
            ema = 0.9 * ema + 0.1 * v
            smooth.append(ema)
        draw.line([xy(i, v) for i, v in enumerate(smooth)], fill=(20, 60, 200), width=2)
        draw.text((4, pad - 6), f"{hi:.3f}", fill="black")
        draw.text((4, h - pad - 6), f"{lo:.3f}", fill="black")
        draw.text((w - pad - 30, h - pad + 8), f"step {len(losses)}", fill="black")
    out.parent.mkdir(parents=True, exist_ok=True)
    img.save(out)
    return out
