import os
import tempfile

# Two torch threads on two busy cores can be 10x slower than one.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Keep the suite's tokenizer files and weight fingerprints out of the user's cache.
os.environ["DIFFPIPE_CACHE"] = tempfile.mkdtemp(prefix="diffpipe-test-cache-")

import torch  # noqa: E402

torch.set_num_threads(1)


# -- running the suite on several workers (pytest-xdist, `make test`) ------------------
# `--dist loadfile` keeps each file on one worker with its module fixtures. Workers take
# files in collection order (`--no-loadscope-reorder`: xdist would otherwise sort files by
# test count, starting the 1-test SLURM file last), and a worker takes its next file once
# at most 2 of its tests are left. So the longest files are collected first, in the order
# that keeps two long ones off one worker; seconds from one suite run on 2 cores, 3 workers.
LONGEST_FIRST = (
    "tests/workflow/test_demo_workflow.py",  # 258 s
    "tests/multiprocess/test_pipeline_parallel.py",  # 210 s
    "tests/cluster/test_slurm.py",  # 200 s, one test: its worker takes the next file at once
    "tests/stages/test_video_families.py",  # 73 s
    "tests/multiprocess/test_data_parallel.py",  # 145 s
    "tests/stages/test_train_resume.py",  # 108 s
    "tests/stages/test_export_formats.py",  # 58 s
    "tests/stages/test_tabular_datasets.py",  # one `diffpipe run`: 47 s CPU alone, 60-120 s wall on a busy machine
    "tests/workflow/test_sbatch_preview.py",  # 41 s
    "tests/stages/test_full_finetune.py",  # 37 s
    "tests/unit/test_estimate.py",  # 30 s
    "tests/stages/test_families.py",  # 26 s
    "tests/stages/test_image_families.py",  # 24 s
)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        return next((i for i, p in enumerate(LONGEST_FIRST) if item.nodeid.startswith(p)), len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: the order inside each file is kept


# -- a cached tiny run shared by the training tests ------------------------------------
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import yaml  # noqa: E402


class TinyRun:
    """A validated, planned and cached tiny-SD run (8 images, 32 px); ``clone`` copies it."""

    def __init__(self, root: Path):
        self.root = root

    def config(self, out: Path, **train) -> dict:
        train = {"epochs": 2, "batch_size": 2, "lora": {"rank": 4, "alpha": 4}, **train}
        return {"output_dir": str(out), "datasets": [{"name": "d", "path": str(self.root / "data"), "resolution": 32}],
                "cache": {"shards": 1}, "train": train}

    def clone(self, dest: Path, **train) -> Path:
        """A new run folder holding the caches; returns its config file."""
        shutil.copytree(self.root / "run", dest / "run", ignore=shutil.ignore_patterns("train"))
        cfg = dest / "config.yaml"
        cfg.write_text(yaml.safe_dump(self.config(dest / "run", **train)))
        return cfg


def run_cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m diffpipe ARGS`` in a fresh process (DeepSpeed owns process-global state)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "diffpipe", *args], env=full_env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> TinyRun:
    from diffpipe import stages
    from diffpipe.config import parse_config
    from diffpipe.data.demo import write_demo_dataset
    from diffpipe.paths import RunPaths

    root = tmp_path_factory.mktemp("tiny-run")
    run = TinyRun(root)
    write_demo_dataset(root / "data", n=8, size=32)
    cfg = parse_config(run.config(root / "run"))
    stages.prepare_data(cfg, RunPaths(cfg.output_dir))
    return run


@pytest.fixture(scope="session")
def cli():
    return run_cli


@pytest.fixture(scope="session")
def golden():
    """``golden(family, run, paths)``: a finished run against tests/assets/golden_losses.json (tests/golden.py)."""
    from golden import check_golden  # tests/golden.py, beside this file

    return check_golden
