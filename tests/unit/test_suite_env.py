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
