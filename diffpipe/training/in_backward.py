"""Optimizer steps inside the backward pass (``train.optimizer_in_backward``).

A full fine-tune normally holds a gradient for every weight until the optimizer
steps: as many bytes again as the weights. Here each parameter gets an optimizer
of its own, stepped by a hook the moment autograd has finished that parameter's
gradient (``register_post_accumulate_grad_hook``); the gradient is freed right
after, so the backward pass holds at most the gradients of the parameters still
being accumulated, never the whole set. What that rules out is refused by the
config: gradient accumulation and clipping need every gradient at once.

DeepSpeed sees :class:`InBackward` as its (torch) optimizer: its ``step`` has
nothing left to do, its ``param_groups`` are the per-parameter optimizers' own
group dicts (so the LR schedule reaches them), and its state dict holds theirs,
so checkpoints save and restore every moment, quantised ones included.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes


class InBackward(torch.optim.Optimizer):
    """One optimizer per trained parameter, each stepped from that parameter's gradient hook.

    ``make`` builds an optimizer from parameter groups (``build_optimizer``); a group's own options (its
    ``lr``) go to the optimizers of its parameters.
    """

    def __init__(self, groups: list[dict[str, Any]], make: Callable[[list[dict[str, Any]]], torch.optim.Optimizer]):
        params = [p for g in groups for p in g["params"] if p.requires_grad]
        super().__init__(params, {})
        self.optimizers: list[torch.optim.Optimizer] = []
        for group in groups:
            options = {k: v for k, v in group.items() if k != "params"}
            self.optimizers += [make([{"params": [p], **options}]) for p in group["params"] if p.requires_grad]
        # The same dicts, not copies: the LR scheduler's writes reach the optimizers that step.
        self.param_groups = [opt.param_groups[0] for opt in self.optimizers]
        self.defaults = dict(self.optimizers[0].defaults) if self.optimizers else {}
        self.skip = False  # set before a backward pass whose loss is not finite: nothing is stepped
        self._norms: list[torch.Tensor] = []
        self._nonfinite = False
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(opt))
                         for opt, p in zip(self.optimizers, params, strict=True)]

    def _hook(self, opt: torch.optim.Optimizer) -> Callable[[torch.Tensor], None]:
        def step(p: torch.Tensor) -> None:
            if not self.skip:
                norm = torch.linalg.vector_norm(p.grad, dtype=torch.float32)
                # A gradient that is not finite would write NaN into the weight and its moments: not applied.
                if torch.isfinite(norm):
                    # Outside any dispatch mode the backward pass runs under (the FLOP counter's first step):
                    # the step is no model FLOP, and torchao's compiled step refuses to trace inside one.
                    with _disable_current_modes():
                        opt.step()
                else:
                    self._nonfinite = True
                self._norms.append(norm)
            p.grad = None  # the point of stepping here: the gradient's memory goes back at once

        return step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Nothing to do: every parameter was stepped during the backward pass."""
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the hooks freed each gradient once it was used."""

    def take(self) -> tuple[float | None, bool]:
        """The gradient norm of the backward pass just run (None when it was skipped) and whether some
        parameter's gradient was not finite (that parameter was left as it was); resets both."""
        norms, bad = self._norms, self._nonfinite
        self._norms, self._nonfinite, self.skip = [], False, False
        if not norms:
            return None, bad
        return math.sqrt(float(torch.stack(norms).square().sum())), bad

    def state_dict(self) -> dict[str, Any]:
        return {"in_backward": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("in_backward")
        if not isinstance(saved, list) or len(saved) != len(self.optimizers):
            n = len(saved) if isinstance(saved, list) else "no"
            raise ValueError(f"the checkpoint's optimizer state holds {n} per-parameter optimizers, this run "
                             f"trains {len(self.optimizers)} parameters with train.optimizer_in_backward")
        for opt, sd in zip(self.optimizers, saved, strict=True):
            opt.load_state_dict(sd)
        self.param_groups = [opt.param_groups[0] for opt in self.optimizers]

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
