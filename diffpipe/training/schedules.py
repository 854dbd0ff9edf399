"""Learning-rate schedules as pure functions of the step (unit-tested)."""

from __future__ import annotations

import math
from collections.abc import Callable


def lr_factor(step: int, *, total: int, warmup: int, kind: str) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based).

    Linear warmup over ``warmup`` steps, then ``constant``, ``linear`` decay to
    0 at ``total``, or ``cosine`` decay to 0 at ``total`` (Loshchilov & Hutter,
    SGDR, 2017, without restarts).
    """
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    span = max(1, total - warmup)
    progress = min(1.0, max(0.0, (step - warmup) / span))
    if kind == "linear":
        return 1.0 - progress
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"train.lr_schedule: unknown schedule {kind!r}")


def lr_lambda(*, total: int, warmup: int, kind: str) -> Callable[[int], float]:
    """A ``torch.optim.lr_scheduler.LambdaLR`` function for the schedule."""
    lr_factor(0, total=total, warmup=warmup, kind=kind)  # fail early on a bad kind
    return lambda step: lr_factor(step, total=total, warmup=warmup, kind=kind)
