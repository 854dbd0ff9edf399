"""Fixtures the unit tests share across files (``make test-fast`` runs them all in one session)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def cached_estimate() -> Iterator[Callable[..., Any]]:
    """``estimate_memory(cfg, **sizes)``, every call sharing one :class:`~diffpipe.meta_denoiser.Reuse`.

    The memory planner's tests, the estimate's tests and the docs' fits-table check ask for the same
    FLUX.1-dev denoisers and traced forwards: each is built or traced once for the session, and each
    estimate after it is arithmetic (``test_estimates_sharing_a_reuse_equal_estimates_made_alone`` holds
    them equal to estimates made alone).
    """
    from diffpipe.estimate import estimate_memory
    from diffpipe.meta_denoiser import Reuse

    with Reuse() as reuse:
        yield functools.partial(estimate_memory, reuse=reuse)


@pytest.fixture(scope="session")
def shallow_flux() -> Any:
    """FLUX.1-dev's published config at the depth of 1 double and 2 single blocks: every part an estimate
    counts (LoRA, quantised layers, blocks to swap and checkpoint), built and traced in a fraction of a second."""
    from diffpipe.families.published import PUBLISHED

    spec = PUBLISHED["flux1-dev"]
    return dataclasses.replace(spec, name="flux1-dev-shallow",
                               config={**spec.config, "num_layers": 1, "num_single_layers": 2})
