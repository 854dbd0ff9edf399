"""Optimizers by name: AdamW, bf16-safe AdamW (Kahan summation or stochastic rounding),
torchao's AdamW with 8-bit or 4-bit moments, Adafactor, and any ``torch.optim`` class.

bf16 has 8 mantissa bits: an update smaller than 1/256 of a weight rounds
away, so plain AdamW on bf16 weights stalls at small learning rates. Two
fixes, both keeping the weights in bf16:
- stochastic rounding rounds up or down with probability proportional to the
  distance, so updates survive on average (Gupta et al. 2015, "Deep Learning
  with Limited Numerical Precision");
- Kahan summation keeps the rounding error of every update in a bf16
  compensation buffer and adds it back next step (Kahan 1965; used for bf16
  training by Zamirai et al. 2020).
Float32 weights (LoRA trains in float32) take the plain update in both.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from diffpipe.config import TrainConfig
from diffpipe.training.in_backward import InBackward


def round_stochastic(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Float32 -> bf16, rounding up or down at random in proportion to the distance (unbiased)."""
    bits = x.float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=x.device, generator=generator)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)


class AdamWBF16(torch.optim.Optimizer):
    """AdamW whose bf16 weights get Kahan-compensated or stochastically rounded updates."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, rounding: str = "kahan"):
        if rounding not in ("kahan", "stochastic"):
            raise ValueError(f"rounding must be 'kahan' or 'stochastic', got {rounding!r}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.rounding = rounding

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                    if p.dtype == torch.bfloat16 and self.rounding == "kahan":
                        state["compensation"] = torch.zeros_like(p)
                state["step"] += 1
                g = p.grad.float()
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                bias1, bias2 = 1 - b1 ** state["step"], 1 - b2 ** state["step"]
                w = p.float()
                update = -lr * (m / bias1) / ((v / bias2).sqrt() + eps) - lr * wd * w
                if p.dtype != torch.bfloat16:
                    p.add_(update.to(p.dtype))
                elif self.rounding == "stochastic":
                    p.copy_(round_stochastic(w + update))
                else:
                    comp = state["compensation"]
                    exact = update + comp.float()
                    new = (w + exact).to(torch.bfloat16)
                    comp.copy_((exact - (new.float() - w)).to(torch.bfloat16))
                    p.copy_(new)
        return loss


def build_training_optimizer(groups: list[dict[str, Any]], tc: TrainConfig) -> torch.optim.Optimizer:
    """:func:`build_optimizer`, or with ``train.optimizer_in_backward`` one such optimizer per parameter, stepped
    in the backward pass (:class:`~diffpipe.training.in_backward.InBackward`)."""
    if not tc.optimizer_in_backward:
        return build_optimizer(groups, tc)
    return InBackward(groups, lambda one: build_optimizer(one, tc))


def build_optimizer(params: list[torch.nn.Parameter] | list[dict[str, Any]], tc: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer ``train.optimizer`` names, with ``train.optimizer_args`` passed through; ``params``
    may be parameter groups (a group's own ``lr`` wins over ``train.lr``)."""
    name, extra = tc.optimizer, dict(tc.optimizer_args)
    common: dict[str, Any] = {"lr": tc.lr, "weight_decay": tc.weight_decay}
    if name == "adamw":
        return torch.optim.AdamW(params, **common, **extra)
    if name in ("adamw_kahan", "adamw_stochastic"):
        return AdamWBF16(params, **common, rounding=name.removeprefix("adamw_"), **extra)
    if name in _TORCHAO:
        # Stochastic rounding applies only where torchao steps bf16 weights itself (optimizer_in_backward under
        # bf16); float32 weights and DeepSpeed's float32 master copies take the plain update.
        extra.setdefault("bf16_stochastic_round", True)
        return _torchao_optimizer(name)(params, **common, **extra)
    if name == "adafactor":
        return torch.optim.Adafactor(params, **common, **extra)
    cls = getattr(torch.optim, name, None)
    if name.lower() in _TORCHAO:
        raise ValueError(f"train.optimizer: {name!r}: write it in lower case ({name.lower()})")
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(
            f"train.optimizer: {name!r} is neither adamw, adamw_kahan, adamw_stochastic, adamw8bit, adamw4bit, "
            "adafactor nor a torch.optim class (e.g. SGD, Adam, RAdam)"
        )
    try:
        return cls(params, **common, **extra)
    except TypeError as err:
        raise ValueError(f"train.optimizer {name}: bad train.optimizer_args {extra}: {err}") from None


#: ``train.optimizer`` -> torchao's class (both AdamW moments block-quantised).
_TORCHAO = {"adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit"}


@cache
def _torchao_optimizer(name: str) -> type[torch.optim.Optimizer]:
    """torchao's class, stepping outside any dispatch mode: the first step of a run is counted under torch's
    FLOP counter (one), where torchao's compiled step refuses to trace, and an optimizer step is no model FLOP."""
    # deferred: importing torchao.optim takes seconds and only these two names need it
    from torchao import optim as torchao_optim

    base = getattr(torchao_optim, _TORCHAO[name])

    class OutsideDispatchModes(base):
        @torch.no_grad()
        def step(self, closure=None):
            with _disable_current_modes():
                return super().step(closure)

    OutsideDispatchModes.__name__ = OutsideDispatchModes.__qualname__ = base.__name__
    return OutsideDispatchModes
