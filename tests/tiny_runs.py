"""The cached tiny runs the training tests share: validated, planned and cached once, cloned per test.

A plain module (not a conftest), so test modules import it by one name: ``from tiny_runs import TinyRun``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml


class TinyRun:
    """A validated, planned and cached tiny-SD run (8 images, 32 px); ``clone`` copies it."""

    def __init__(self, root: Path, family: str = "sd"):
        self.root = root
        self.family = family

    def config(self, out: Path, **train) -> dict:
        train = {"epochs": 2, "batch_size": 2, "lora": {"rank": 4, "alpha": 4}, **train}
        model = {} if self.family == "sd" else {"model": {"family": self.family, "flavor": "tiny"}}
        return {"output_dir": str(out), **model,
                "datasets": [{"name": "d", "path": str(self.root / "data"), "resolution": 32}],
                "cache": {"shards": 1}, "train": train}

    def clone(self, dest: Path, **train) -> Path:
        """A new run folder holding the caches; returns its config file."""
        shutil.copytree(self.root / "run", dest / "run", ignore=shutil.ignore_patterns("train"))
        cfg = dest / "config.yaml"
        cfg.write_text(yaml.safe_dump(self.config(dest / "run", **train)))
        return cfg


def make_tiny_run(root: Path, family: str = "sd", images: int = 8) -> TinyRun:
    """Demo images under ``root/data``, validated, planned and cached (empty caption too) for ``family``."""
    from diffpipe import stages
    from diffpipe.config import parse_config
    from diffpipe.data.dataset.demo import write_demo_dataset
    from diffpipe.paths import RunPaths

    run = TinyRun(root, family)
    write_demo_dataset(root / "data", n=images, size=32)
    cfg = parse_config(run.config(root / "run"))
    stages.prepare_data(cfg, RunPaths(cfg.output_dir))
    return run


def bench_config(run: TinyRun, tmp_path: Path, train: dict | None = None, **bench) -> str:
    """A config file for ``diffpipe bench`` on ``run``'s caches: 1 warm-up step, 2 measured, ``bench`` keys added."""
    cfg = run.config(tmp_path / "run", **(train or {}))
    cfg["bench"] = {"warmup_steps": 1, "steps": 2, **bench}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)
