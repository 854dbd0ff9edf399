"""Experiment trackers (diffpipe/training/trackers.py): one real `diffpipe train` logging to TensorBoard,
W&B (offline) and MLflow (file store), every logged value read back with each tool's own format and
compared with metrics.jsonl."""

from __future__ import annotations

import json
import struct

import pytest
import yaml
from typer.testing import CliRunner

from diffpipe.cli import app
from diffpipe.training import trackers
from diffpipe.training.metrics import read_metrics


def test_scalars_take_every_numeric_field_of_a_row():
    row = {"epoch": 1, "loss": 0.5, "lr": 1e-3, "tflops": 12, "mfu": 0.25, "eval_loss_q0.5": 0.7,
           "flag": True, "note": "text"}
    assert trackers.scalars(row) == {"train/loss": 0.5, "train/lr": 1e-3, "train/tflops": 12.0,
                                     "train/mfu": 0.25, "eval/loss_q0.5": 0.7}


def _wandb_records(path):
    """The protobuf records of a ``.wandb`` file: a 7-byte W&B header, then LevelDB log records in 32 KiB
    blocks (4-byte checksum, 2-byte length, 1-byte type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _wandb_history(run_dir):
    (log,) = run_dir.glob("wandb/wandb/offline-run-*/run-*.wandb")
    history, config = {}, {}
    for record in _wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            history.setdefault(items.pop("_step", 0), {}).update(items)  # W&B leaves out a step of 0
        elif kind == "run":
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
    return history, config


@pytest.fixture(scope="module")
def tracked(tiny_run, tmp_path_factory, cli):
    dest = tmp_path_factory.mktemp("trackers")
    config = tiny_run.clone(dest, trackers=["tensorboard", "wandb", "mlflow"], tracker_project="diffpipe-test",
                            run_name="tracked", sample_every_epochs=2)
    data = yaml.safe_load(config.read_text())
    data["sample"] = {"prompts": ["a red circle"], "steps": 2, "width": 32, "height": 32}
    config.write_text(yaml.safe_dump(data))
    result = cli("train", "-c", str(config), env={"WANDB_MODE": "offline"})
    assert result.returncode == 0, result.stdout + result.stderr
    return dest / "run" / "train"


def test_wandb_offline_logs_the_metrics_rows(tracked):
    rows = read_metrics(tracked / "metrics.jsonl")
    history, config = _wandb_history(tracked)
    assert config["train"]["run_name"] == "tracked"  # the resolved config
    for row in rows:
        logged = history[row["step"]]
        for name, value in trackers.scalars(row).items():
            assert logged[name] == pytest.approx(value, rel=1e-12), (row["step"], name)
    assert history[0]["eval/loss"] > 0  # the eval baseline before training (not a metrics.jsonl row)
    (image,) = tracked.glob("wandb/wandb/offline-run-*/files/media/images/samples_*.png")
    assert history[rows[-1]["step"]]["samples/path"].endswith(image.name)  # the sample grid, at its step


def test_mlflow_file_store_logs_the_metrics_rows(tracked, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tracked / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("diffpipe-test").experiment_id])
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    rows = read_metrics(tracked / "metrics.jsonl")
    for name in trackers.scalars(rows[-1]):
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
        for row in rows:
            if name in trackers.scalars(row):
                assert history[row["step"]] == trackers.scalars(row)[name], (row["step"], name)
    artifacts = tracked / "mlruns" / run.info.experiment_id / run.info.run_id / "artifacts"
    assert json.loads((artifacts / "config.json").read_text())["train"]["trackers"] == ["tensorboard", "wandb",
                                                                                       "mlflow"]
    assert list((artifacts / "samples").glob("step-*.png"))


def test_tensorboard_still_logs_the_same_rows(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tracked / "tensorboard"))
    events.Reload()
    rows = read_metrics(tracked / "metrics.jsonl")
    loss = {e.step: e.value for e in events.Scalars("train/loss")}
    assert loss == pytest.approx({r["step"]: r["loss"] for r in rows}, rel=1e-6)  # float32 in TensorBoard
    assert events.Tags()["images"] == ["samples"]


def test_a_missing_tracker_package_stops_train_before_it_starts(tiny_run, tmp_path, monkeypatch):
    # wandb is installed here (dev extra); a module name that cannot exist stands in for its absence.
    monkeypatch.setitem(trackers.PACKAGES, "wandb", ("diffpipe_no_such_module", "wandb"))
    config = tiny_run.clone(tmp_path, trackers=["wandb"])
    result = CliRunner().invoke(app, ["train", "-c", str(config)])
    assert result.exit_code == 2, result.output
    assert "train.trackers: wandb needs the wandb package" in result.output and "pip install wandb" in result.output
    assert not (tmp_path / "run" / "train" / "metrics.jsonl").exists()


def test_wandb_without_a_login_stops_train_before_the_model_loads(tiny_run, tmp_path, monkeypatch):
    from diffpipe.training import loop

    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_DISABLED", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    loaded = []
    monkeypatch.setattr(loop, "get_family", lambda cfg: loaded.append(cfg) or pytest.fail("the model loaded"))
    config = tiny_run.clone(tmp_path, trackers=["wandb"])
    result = CliRunner().invoke(app, ["train", "-c", str(config)])
    assert result.exit_code == 2, result.output
    assert "train.trackers: wandb" in result.output and "wandb login" in result.output and loaded == []
