"""An exponential moving average of the trained weights (``train.ema``), through diffusers' ``EMAModel``.

The average is kept in float32 whatever the training precision (the shadow copies are made float32; a
bf16 parameter is promoted when it is folded in), updated after every ``update_every``-th optimizer step
with ``EMAModel``'s decay: 0 at the first update (the average starts at the weights), then
``min(decay, (1 + t) / (10 + t))`` at update ``t + 1``. Its state goes into every checkpoint
(``ema.safetensors`` beside the adapter), so a resumed run's average equals an uninterrupted one's.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from diffusers.training_utils import EMAModel
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from diffpipe.config import EmaConfig
from diffpipe.utils import atomic_path

STATE_NAME = "ema.safetensors"


class Ema:
    """The average of ``params`` (the trained parameters, in the engine's module)."""

    def __init__(self, params: list[torch.nn.Parameter], cfg: EmaConfig):
        self.cfg, self.params = cfg, list(params)
        self.model = EMAModel(self.params, decay=cfg.decay, min_decay=0.0, update_after_step=0,
                              use_ema_warmup=False, foreach=False)
        self.model.shadow_params = [p.detach().float().clone() for p in self.params]

    def update(self, step: int) -> None:
        """Fold the weights after optimizer step ``step`` (1-based) in, on every ``update_every``-th step."""
        if step % self.cfg.update_every == 0:
            self.model.step(self.params)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The trained parameters hold the average inside the block, their own values after it."""
        self.model.store(self.params)
        self.model.copy_to(self.params)
        try:
            yield
        finally:
            self.model.restore(self.params)

    def save(self, path: Path) -> None:
        """The average and its update count as one safetensors file, written atomically."""
        tensors = {f"shadow.{i}": s.detach().cpu().contiguous() for i, s in enumerate(self.model.shadow_params)}
        meta = {"optimization_step": str(self.model.optimization_step), "decay": json.dumps(self.cfg.decay)}
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata=meta)

    def load(self, path: Path) -> None:
        """Restore the state :meth:`save` wrote (a resumed run); a clear error when it is missing or does not fit."""
        if not path.is_file():
            raise ValueError(f"{path}: the checkpoint has no EMA state (train.ema was off when it was written); "
                             "resume from a checkpoint of a run with train.ema.enabled, or turn it off")

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
        shadow = [tensors.get(f"shadow.{i}") for i in range(len(self.params))]
        if len(tensors) != len(self.params) or any(
                s is None or s.shape != p.shape for s, p in zip(shadow, self.params, strict=True)):
            raise ValueError(f"{path}: the EMA state does not match the trained parameters "
                             f"({len(tensors)} tensors for {len(self.params)} parameters)")
        device = self.params[0].device
        self.model.shadow_params = [s.float().to(device) for s in shadow]
        self.model.optimization_step = int(meta.get("optimization_step", 0))
