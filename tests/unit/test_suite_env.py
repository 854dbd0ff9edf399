"""The suite's own environment (tests/conftest.py): what every process it starts inherits."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest


def test_every_process_finds_the_ninja_of_this_interpreter():
    """DeepSpeed builds its CPU op with the first `ninja` on PATH; Snakemake's jobs find this interpreter's
    (``diffpipe run`` puts its folder first). A process of the suite finding another ninja would rebuild
    the op (two ninja versions do not read each other's build log), about 45 s of CPU each time."""
    ours = os.path.join(os.path.dirname(sys.executable), "ninja")
    if not os.access(ours, os.X_OK):
        pytest.skip(f"no ninja beside {sys.executable}: every process finds the same one on PATH")
    assert shutil.which("ninja") == ours
    child = subprocess.run([sys.executable, "-c", "import shutil; print(shutil.which('ninja'))"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == ours


def test_a_training_process_started_outside_the_venv_builds_with_the_venvs_ninja():
    """``diffpipe train`` from a shell whose PATH lacks the venv: DeepSpeed must still find the venv's ninja
    (the one ``diffpipe run``'s jobs use), or each switch between the two rebuilds its CPU op."""
    ours = os.path.join(os.path.dirname(sys.executable), "ninja")
    if not os.access(ours, os.X_OK):
        pytest.skip(f"no ninja beside {sys.executable}: nothing to choose between")
    folder = os.path.dirname(sys.executable)
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != folder)
    code = ("import shutil; from diffpipe.training import engine; engine._this_interpreters_ninja_first(); "
            "print(shutil.which('ninja'))")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env=dict(os.environ, PATH=path))
    assert child.stdout.strip() == ours
