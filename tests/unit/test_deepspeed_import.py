"""DeepSpeed is imported without MLflow (its autotuner would import it: about 1 s of CPU in every training
process), and MLflow stays importable for an MLflow tracker afterwards."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
from diffpipe.training.engine import load_deepspeed
load_deepspeed()
print("mlflow imported by deepspeed:", "mlflow" in sys.modules)
import mlflow
print("mlflow importable:", bool(mlflow.__version__))
"""


def test_deepspeed_comes_without_mlflow_and_mlflow_still_imports():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "mlflow imported by deepspeed: False" in out.stdout and "mlflow importable: True" in out.stdout
