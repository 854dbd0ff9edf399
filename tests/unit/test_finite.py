"""The non-finite checks (diffpipe.training.finite): exact, named, counted."""

from __future__ import annotations

import math

import pytest
import torch

from diffpipe.training.finite import NonFiniteError, StepGuard, Streak, all_finite, check_tensors, nonfinite_names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_finite_is_exact(dtype):
    huge = torch.full((4,), 3.0e38).to(dtype)  # a norm would overflow: the max-abs does not
    assert all_finite([huge, torch.zeros(3, dtype=dtype), torch.tensor([], dtype=dtype)])
    for bad in (math.nan, math.inf, -math.inf):
        t = torch.ones(5, dtype=dtype)
        t[2] = bad
        assert not all_finite([huge, t])
    assert all_finite([torch.arange(3)])  # integer tensors hold no NaN


def test_names_and_refusal():
    sd = {"a.lora_A.weight": torch.ones(2), "b.lora_B.weight": torch.tensor([1.0, math.nan]),
          "c.lora_B.weight": torch.tensor([math.inf])}
    assert nonfinite_names(sd.items()) == ["b.lora_B.weight", "c.lora_B.weight"]
    with pytest.raises(NonFiniteError, match=r"export: x.safetensors holds 2 tensor\(s\).*b.lora_B.weight, c.lora_B"):
        check_tensors(sd, "x.safetensors", what="export")
    check_tensors({"a": torch.ones(2)}, "x", what="export")


def test_streak_counts_and_stops():
    lines: list[str] = []
    streak = Streak(limit=2)
    streak.record(1, False, loss=1.0, grad_norm=1.0, log=lines.append, last_checkpoint=None)
    streak.record(2, True, loss=math.nan, grad_norm=None, log=lines.append, last_checkpoint=None)
    streak.record(3, False, loss=1.0, grad_norm=1.0, log=lines.append, last_checkpoint=None)
    streak.record(4, True, loss=math.nan, grad_norm=math.inf, log=lines.append, last_checkpoint=None)
    assert ["step 2:" in lines[0], "(1 in a row, 1 in this run" in lines[0]] == [True, True]
    assert ["step 4:" in lines[1], "(1 in a row, 2 in this run" in lines[1]] == [True, True]
    resumed = Streak(limit=2)
    resumed.load(streak.state())
    with pytest.raises(NonFiniteError, match="stopped at step 5: 2 optimizer steps in a row \\(steps 4-5\\)"):
        resumed.record(5, True, loss=math.nan, grad_norm=None, log=lines.append, last_checkpoint=None)
    assert resumed.total == 3


def test_step_guard_skips_nonfinite_gradients_and_when_told():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.5)
    guard = StepGuard(opt)
    p.grad = torch.tensor([1.0, math.nan, 1.0])
    opt.step()
    assert guard.take() and opt.overflow and torch.equal(p.detach(), torch.ones(3))
    p.grad = torch.ones(3)
    guard.skip_next = True  # the loss was not finite
    opt.step()
    assert guard.take() and torch.equal(p.detach(), torch.ones(3))
    opt.step()
    assert not guard.take() and not opt.overflow and torch.equal(p.detach(), torch.full((3,), 0.5))
