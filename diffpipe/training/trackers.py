"""Experiment trackers: TensorBoard (the default), Weights & Biases and MLflow behind one small interface.

Each tracker receives what ``metrics.jsonl`` holds, row by row (every numeric field but ``epoch``, named
``train/<field>`` and ``eval/<name>`` for the ``eval_<name>`` fields), the sample grids the training
loop renders, and the resolved config. Only rank 0 opens them (:class:`diffpipe.training.metrics.MetricsWriter`).

Where they write, under the run's ``train/`` folder unless the environment says otherwise:
- ``tensorboard``: ``train/tensorboard/``;
- ``wandb``: ``train/wandb/``; ``WANDB_MODE=offline`` logs without an account (``wandb sync`` uploads later),
  otherwise ``wandb login`` or ``WANDB_API_KEY``;
- ``mlflow``: the file store ``train/mlruns/`` (MLflow 3 keeps it in maintenance mode: diffpipe sets
  ``MLFLOW_ALLOW_FILE_STORE=true`` for it; view with ``MLFLOW_ALLOW_FILE_STORE=true mlflow ui
  --backend-store-uri train/mlruns`` from the full ``mlflow`` package), or the server ``MLFLOW_TRACKING_URI`` names.
"""

from __future__ import annotations

import importlib.util
import json
import netrc
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from PIL import Image

#: tracker -> (module it imports, the pip package that provides it).
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow-skinny")}


def problems(names: list[str]) -> list[str]:
    """One line per tracker in ``names`` that cannot log: its package is not installed, or W&B has no login.

    ``diffpipe run`` (before Snakemake) and ``diffpipe train`` (before the model loads) stop on them.
    """
    return missing_packages(names) + ([line] if "wandb" in names and (line := wandb_login_problem()) else [])


#: ``WANDB_MODE`` values that log without an account.
_WANDB_LOCAL = {"offline", "dryrun", "disabled"}


def wandb_login_problem() -> str | None:
    """None when W&B can log without asking: offline or disabled mode, a key in the environment, or the
    netrc entry ``wandb login`` writes for the server's host. Read here, with no network, because
    ``wandb.init`` would otherwise fail only after the model has loaded."""
    mode = os.environ.get("WANDB_MODE", "").strip().lower()
    disabled = os.environ.get("WANDB_DISABLED", "").strip().lower() in ("1", "true", "yes")
    if mode in _WANDB_LOCAL or disabled or os.environ.get("WANDB_API_KEY") or os.environ.get(
            "WANDB_IDENTITY_TOKEN_FILE"):
        return None
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    if _netrc_has(host):
        return None
    return (f"train.trackers: wandb has no login for {host}: run `wandb login` (it writes the key to your "
            "netrc file), or set WANDB_API_KEY; WANDB_MODE=offline logs without an account (`wandb sync` "
            "uploads later); or remove wandb from train.trackers")


def _netrc_has(host: str) -> bool:
    """Whether the netrc file W&B reads (``NETRC``, else ``~/.netrc`` or ``~/_netrc``) holds a key for ``host``."""
    if value := os.environ.get("NETRC"):
        candidates = [Path(value).expanduser()]
    else:
        candidates = [Path("~/.netrc").expanduser(), Path("~/_netrc").expanduser()]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None or not host:
        return False
    try:
        entry = netrc.netrc(str(path)).authenticators(host)
    except (netrc.NetrcParseError, OSError):
        return False  # W&B cannot read it either
    return bool(entry and entry[2])


def missing_packages(names: list[str]) -> list[str]:
    """One line per tracker in ``names`` whose package is not installed, naming the pip command."""
    lines = []
    for name in names:
        module, package = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            lines.append(f"train.trackers: {name} needs the {package} package, which is not installed: "
                         f"pip install {package} (or pip install 'diffpipe[trackers]')")
    return lines


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of a metrics row under their tracker names (``train/loss``, ``eval/loss_q0.5``)."""
    out = {}
    for name, value in row.items():
        if isinstance(value, int | float) and not isinstance(value, bool) and name not in ("epoch", "step"):
            out[name.replace("eval_", "eval/", 1) if name.startswith("eval_") else f"train/{name}"] = float(value)
    return out


class Tracker(ABC):
    """One destination of the run's scalars, images and config."""

    @abstractmethod
    def log(self, step: int, values: dict[str, float]) -> None:
        """Scalars at ``step`` (names as :func:`scalars` gives them)."""

    @abstractmethod
    def image(self, tag: str, image: Image.Image, step: int) -> None:
        """An image at ``step`` (the sample grid)."""

    def close(self) -> None:  # noqa: B027 - a tracker with nothing to flush needs no close
        """Flush and finish."""


class TensorBoard(Tracker):
    def __init__(self, folder: Path, purge_step: int | None):
        # deferred: torch + tensorboard take seconds to import, and `diffpipe run` imports this module to
        # check the trackers before any job starts
        from torch.utils.tensorboard import SummaryWriter

        # ``purge_step`` hides events a killed run logged past its resume point.
        self._tb = SummaryWriter(str(folder), purge_step=purge_step)

    def log(self, step, values):
        for tag, value in values.items():
            self._tb.add_scalar(tag, value, step)

    def image(self, tag, image, step):
        # deferred: numpy costs ~0.4 s, which `diffpipe run`'s tracker check would pay; the writer loaded it already
        import numpy as np

        self._tb.add_image(tag, np.asarray(image.convert("RGB")), step, dataformats="HWC")

    def close(self):
        self._tb.close()


class WandB(Tracker):
    def __init__(self, folder: Path, project: str, run_name: str, config: dict[str, Any]):
        import wandb  # deferred: optional dependency (pip install 'diffpipe[trackers]')

        folder.mkdir(parents=True, exist_ok=True)
        self._wandb = wandb
        self._run = wandb.init(project=project, name=run_name, dir=str(folder), config=config,
                               settings=wandb.Settings(console="off", silent=True))

    def log(self, step, values):
        self._run.log(values, step=step)

    def image(self, tag, image, step):
        self._run.log({tag: self._wandb.Image(image.convert("RGB"))}, step=step)

    def close(self):
        self._run.finish()


class MLflow(Tracker):
    def __init__(self, folder: Path, project: str, run_name: str, config: dict[str, Any]):
        from mlflow.tracking import MlflowClient  # deferred: optional dependency (diffpipe[trackers])

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # MLflow 3 keeps its file store in maintenance mode and refuses it unless asked; mlflow-skinny has
            # no database backend, and a folder of files under the run is what a local run wants.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = folder.absolute().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        self.client.log_text(self.run_id, json.dumps(config, indent=1, default=str), "config.json")

    def log(self, step, values):
        from mlflow.entities import Metric  # deferred: optional dependency (diffpipe[trackers])

        now = int(__import__("time").time() * 1000)
        metrics = [Metric(tag, value, now, step) for tag, value in values.items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def image(self, tag, image, step):
        self.client.log_image(self.run_id, image.convert("RGB"), f"{tag}/step-{step:07d}.png")

    def close(self):
        self.client.set_terminated(self.run_id)


def open_trackers(names: list[str], train_dir: Path, *, tensorboard_dir: Path, purge_step: int | None = None,
                  project: str = "diffpipe", run_name: str | None = None,
                  config: dict[str, Any] | None = None) -> list[Tracker]:
    """The trackers ``names`` lists, writing under ``train_dir``; a missing package is a ValueError naming it."""
    if problems := missing_packages(names):
        raise ValueError("\n".join(problems))
    run_name = run_name or train_dir.parent.name
    config = config or {}
    opened: list[Tracker] = []
    for name in names:
        if name == "tensorboard":
            opened.append(TensorBoard(tensorboard_dir, purge_step))
        elif name == "wandb":
            opened.append(WandB(train_dir / "wandb", project, run_name, config))
        else:
            opened.append(MLflow(train_dir / "mlruns", project, run_name, config))
    return opened
