import os
import sys
import tempfile

# Two torch threads on two busy cores can be 10x slower than one.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# One `ninja` for every process of the suite. DeepSpeed compiles its CPU shared-memory op (on first use,
# cached in ~/.cache/torch_extensions) with the `ninja` first on PATH. `diffpipe run` puts this
# interpreter's folder first for its jobs (the venv's ninja), while `.venv/bin/python -m pytest` and the
# processes it starts found the system's, if any. Two ninja versions do not share a build log, so each
# switch rebuilt the op: 41-48 s of CPU (3 s to load it built), every DeepSpeed process starting meanwhile
# waiting on its lock (tests/unit/test_suite_env.py).
os.environ["PATH"] = f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ.get('PATH', '')}"
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
# that keeps two long ones off one worker. Seconds: the suite run of 2026-11-27 (2 cores, 3 workers),
# less what the split files moved out (bench: grid and convergence; the hybrid pipeline test went
# to test_data_parallel.py, beside the ZeRO-1 run it reuses) and what the smaller SLURM run saves.
LONGEST_FIRST = (
    "tests/workflow/test_demo_workflow.py",  # 250 s
    "tests/multiprocess/test_pipeline_parallel.py",  # 190 s, less its 1-process bf16 run (now gone)
    "tests/cluster/test_slurm.py",  # 220 s, one test: its worker takes the next file at once
    "tests/stages/test_bench.py",  # 80 s: every bench point is a process
    "tests/multiprocess/test_data_parallel.py",  # 150 s
    "tests/workflow/test_safety_workflow.py",  # 147 s
    # 116 s with a cold inductor cache (CI: 137-231 s before the 8-bit resume test lost its third run), 32 s
    # warm: torchao compiles its 8-bit step once per parameter shape, in each of the 2 processes
    "tests/stages/test_full_finetune.py",
    "tests/stages/test_tabular_datasets.py",  # 125 s: one `diffpipe run` from a hub dataset
    "tests/stages/test_text_encoder_training.py",  # 105 s
    "tests/stages/test_bench_convergence.py",  # 70 s: a process per precision
    "tests/stages/test_video_families.py",  # 73 s
    "tests/stages/test_fp8_base_weights.py",  # 70 s
    "tests/stages/test_train_resume.py",  # 70 s
    "tests/stages/test_nonfinite.py",  # 90 s: diverging runs, a resume
    "tests/stages/test_gpu_kit.py",  # 50 s: the GPU kit's dry run, a process per check
    "tests/stages/test_export_formats.py",  # 58 s
    "tests/unit/test_family_runs.py",  # 45 s: every family and variant takes a step
    "tests/workflow/test_sbatch_preview.py",  # 41 s
    "tests/unit/test_estimate.py",  # 30 s
    "tests/stages/test_families.py",  # 26 s
    "tests/stages/test_image_families.py",  # 24 s
    # 120 s: four `diffpipe run`s stopped by signals. Not beside the SLURM and demo workflows at the start:
    # there, on 2 busy cores, a SIGINT-stopped run once took over 120 s to end. Nor last: its worker would
    # then run it alone while the others sit idle. After the long files, the short stage and unit files
    # that follow keep the other workers busy while it runs.
    "tests/workflow/test_interrupts.py",
)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        return next((i for i, p in enumerate(LONGEST_FIRST) if item.nodeid.startswith(p)), len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: the order inside each file is kept


# -- a cached tiny run shared by the training tests ------------------------------------
import subprocess  # noqa: E402

import pytest  # noqa: E402
from tiny_runs import TinyRun, make_tiny_run  # noqa: E402  (tests/tiny_runs.py)


def run_cli(*args: str, env: dict | None = None, timeout: float = 1200) -> subprocess.CompletedProcess:
    """``python -m diffpipe ARGS`` in a fresh process (DeepSpeed owns process-global state)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "diffpipe", *args], env=full_env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> TinyRun:
    """A validated, planned and cached tiny-SD run (8 images, 32 px), shared by the session."""
    return make_tiny_run(tmp_path_factory.mktemp("tiny-run"))


@pytest.fixture(scope="session")
def cli():
    return run_cli


@pytest.fixture(scope="session")
def golden():
    """``golden(family, run, paths)``: a finished run against tests/assets/golden_losses.json (tests/golden.py)."""
    from golden import check_golden  # tests/golden.py, beside this file

    return check_golden
