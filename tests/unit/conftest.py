"""Fixtures the unit tests share across files (``make test-fast`` runs them all in one session)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest


@pytest.fixture(scope="session")
def cached_estimate() -> Callable[..., Any]:
    """``estimate_memory(cfg, **sizes)``, each distinct question answered once for the session.

    The memory planner's tests, the estimate's tests and the docs' fits-table check ask for the same
    FLUX.1-dev estimates (a meta-device forward each, about a second). The key is everything an estimate
    reads: the model section, the datasets less their names and folders (tests write them under their own
    tmp_path), the train section less the keys no size depends on (the memory keys the planner fills in,
    the learning rate), and the sizes passed.
    """
    from diffpipe.estimate import estimate_memory

    cache: dict[str, Any] = {}

    def one(cfg, **sizes):
        train = cfg.train.model_dump(mode="json", exclude={"memory", "gpu_memory", "lr"})
        datasets = [d.model_dump(mode="json", exclude={"name", "path"}) for d in cfg.datasets]
        key = json.dumps([cfg.model.model_dump(mode="json"), datasets, train, sizes], sort_keys=True)
        if key not in cache:
            cache[key] = estimate_memory(cfg, **sizes)
        return cache[key]

    return one
