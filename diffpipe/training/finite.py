"""Non-finite is never saved: NaN / inf losses and gradients skip their optimizer step, weights that are
not finite are never written, and an adapter file holding them is refused by export and sample.

The checks are one fused reduction each (``torch._foreach_norm``: NaN or inf when a tensor holds one),
run on the tensors where they already are, in their own dtype: no copy of the weights or gradients.
Only when that finds something are the tensors looked at one by one, to confirm and to name them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

#: How many tensor names an error lists before "and N more".
SHOWN = 5


class NonFiniteError(ValueError):
    """Training diverged (NaN / inf), or an adapter holds tensors that are not finite."""


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Are all values of all ``tensors`` finite? One fused L2 norm per device and dtype (NaN and inf
    propagate into it); only when that is not finite, which huge finite values can also cause, are the
    tensors checked one by one."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t.is_floating_point() and t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t)
    for ts in groups.values():
        if not bool(torch.isfinite(torch.stack(torch._foreach_norm(ts))).all()):
            if not all(bool(torch.isfinite(t).all()) for t in ts):
                return False
    return True


def nonfinite_names(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the tensors holding a NaN or an inf, checked tensor by tensor."""
    return [name for name, t in named if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def describe(names: list[str]) -> str:
    """``a, b, c (and 4 more)``."""
    more = f" (and {len(names) - SHOWN} more)" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def check_tensors(tensors: Mapping[str, torch.Tensor], source: str | Path, *, what: str) -> None:
    """Refuse ``tensors`` (read from ``source``) when any is not finite, naming them; ``what`` the refused action."""
    if all_finite(tensors.values()):
        return
    raise _refused(what, source, nonfinite_names(tensors.items()))


def check_safetensors_file(path: str | Path, *, what: str) -> None:
    """:func:`check_tensors` on a safetensors file, one tensor in memory at a time."""
    bad = []
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118  (safe_open is no mapping)
            t = f.get_tensor(key)
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                bad.append(key)
    if bad:
        raise _refused(what, path, bad)


def _refused(what: str, source: str | Path, names: list[str]) -> NonFiniteError:
    return NonFiniteError(
        f"{what}: {source} holds {len(names)} tensor(s) with NaN or inf values: {describe(names)}. The training "
        "that wrote it diverged: use the LoRA of a checkpoint from before it (`diffpipe export --checkpoint "
        "step-NNNNNN` exports one; train/metrics.jsonl shows where the loss stopped being finite) or train again "
        "with a lower train.lr")


class StepGuard:
    """Wraps a torch optimizer's ``step``: it is skipped when the loop asks (``skip_next``: the loss was not
    finite) or when the gradients it would apply are not finite.

    The optimizer is the one handed to DeepSpeed: without ZeRO and without DeepSpeed's bf16 optimizer it is
    the engine's optimizer itself, and ``overflow`` tells DeepSpeed the step was skipped (it then leaves the
    LR schedule where it is, as it does for its own overflow skips). Under ZeRO 1-3 and bf16, DeepSpeed
    checks the gradient norm itself before calling this step and skips on NaN / inf
    (``engine.was_step_applied()``); the guard then sees its partition's gradients, already checked.
    Nothing here is collective: the loop makes the ranks agree.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer, self.skip_next, self.skipped = optimizer, False, False
        self._step = optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            return self._guarded(*args, **kwargs)

        # What torch's LR scheduler marks its own wrapper with: it then does not warn that step was replaced.
        step._wrapped_by_lr_sched = True
        optimizer.overflow = False
        optimizer.step = step

    def _guarded(self, *args: Any, **kwargs: Any) -> Any:
        grads = [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        if self.skip_next or not all_finite(grads):
            self.skipped = self.optimizer.overflow = True
            return None  # DeepSpeed zeroes the gradients after every step, skipped or not
        self.optimizer.overflow = False
        return self._step(*args, **kwargs)

    def take(self) -> bool:
        """Whether the step since the last call was skipped here; resets for the next step."""
        skipped, self.skipped, self.skip_next = self.skipped, False, False
        return skipped


@dataclass
class Streak:
    """Skipped steps: in a row now, and in the whole run (kept in checkpoints, so a resume stops where the
    uninterrupted run would)."""

    limit: int
    in_a_row: int = 0
    total: int = 0
    first: int = 0  # the first step of the current run of skipped steps

    def record(self, step: int, skipped: bool, *, loss: float, grad_norm: float | None, log,
               last_checkpoint: Path | None) -> None:
        """Count ``step`` (1-based); warn when it was skipped, raise after ``limit`` in a row
        (``last_checkpoint``: the run's newest, named in the error)."""
        if not skipped:
            self.in_a_row = 0
            return
        self.first = step if self.in_a_row == 0 else self.first
        self.in_a_row += 1
        self.total += 1
        norm = "n/a" if grad_norm is None else f"{grad_norm:g}"
        if self.in_a_row >= self.limit:
            raise NonFiniteError(
                f"train: stopped at step {step}: {self.in_a_row} optimizer steps in a row (steps {self.first}-{step}) "
                f"had a loss or gradients that are not finite (last loss {loss:g}, gradient norm {norm}); "
                f"train.max_nonfinite_steps is {self.limit}. Training diverged: lower train.lr, keep "
                "train.grad_clip on, or check the data. No checkpoint is written during skipped steps; "
                + (f"the newest, {last_checkpoint}, is from before them" if last_checkpoint else
                   "this run wrote no checkpoint"))
        log(f"train: warning: step {step}: loss {loss:g}, gradient norm {norm}: not finite; its optimizer step "
            f"was skipped ({self.in_a_row} in a row, {self.total} in this run; train.max_nonfinite_steps "
            f"{self.limit} in a row stop the run)")

    def state(self) -> dict[str, int]:
        return {"in_a_row": self.in_a_row, "total": self.total, "first": self.first}

    def load(self, state: Mapping[str, int]) -> None:
        self.in_a_row, self.total, self.first = (int(state.get(k, 0)) for k in ("in_a_row", "total", "first"))
