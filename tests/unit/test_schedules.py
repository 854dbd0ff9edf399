import math

import pytest

from diffpipe.training.schedules import lr_factor, lr_lambda


def test_warmup_is_linear_then_peak():
    f = [lr_factor(s, total=100, warmup=4, kind="constant") for s in range(6)]
    assert f == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_decay_reaches_zero_at_total(kind):
    assert lr_factor(10, total=110, warmup=10, kind=kind) == pytest.approx(1.0)
    assert lr_factor(110, total=110, warmup=10, kind=kind) == pytest.approx(0.0, abs=1e-12)
    mids = [lr_factor(s, total=110, warmup=10, kind=kind) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(mids, mids[1:], strict=False))


def test_cosine_midpoint():
    assert lr_factor(50, total=100, warmup=0, kind="cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi / 2)))


def test_unknown_schedule():
    with pytest.raises(ValueError, match="lr_schedule"):
        lr_lambda(total=10, warmup=0, kind="step")
