"""Checkpoints and exact resume on the tiny model, through the real CLI (one process).

One uninterrupted run is the reference (it also renders samples during
training, which must not disturb it); a second run is killed in the middle of
writing a checkpoint and resumed: its per-step losses and final LoRA must
match the reference.

The reference's losses and adapter are also compared with the golden values in
``tests/assets/golden_losses.json``; ``DIFFPIPE_UPDATE_GOLDEN=1`` rewrites them
deliberately (see ``tests/golden.py``).
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from PIL import Image
from stage_cli import in_process

from diffpipe.paths import RunPaths
from diffpipe.training.adapter import load_adapter
from diffpipe.training.checkpoint import adapter_from_checkpoint, list_checkpoints
from diffpipe.training.metrics import read_metrics

TRAIN = {"checkpoint_every_steps": 2, "keep_checkpoints": 2, "lr_schedule": "cosine", "warmup_steps": 2,
         "eval": {"quantiles": [0.1, 0.9], "max_items": 4},
         "lora": {"rank": 4, "alpha": 8, "dropout": 0.1}}


@pytest.fixture(scope="module")
def reference(tiny_run, cli, tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    # Samples during training (must not change the losses the resumed run is compared with).
    cfg = tiny_run.clone(root, **{**TRAIN, "keep_checkpoints": 0, "sample_every_steps": 4})
    data = yaml.safe_load(cfg.read_text())
    data["sample"] = {"prompts": ["a red circle", "a blue square"], "steps": 2, "width": 32, "height": 32}
    cfg.write_text(yaml.safe_dump(data))
    paths = RunPaths(root / "run")
    paths.train_dir.mkdir(parents=True)
    (paths.train_dir / "save").touch()  # a save request: checkpoint after step 1
    result = cli("train", "-c", str(cfg))
    assert result.returncode == 0, result.stderr[-3000:]
    return paths


def test_save_request_and_step_checkpoints(reference):
    names = [p.name for p in list_checkpoints(reference.checkpoints)]
    assert names == ["step-000001", "step-000002", "step-000004", "step-000006", "step-000008"]
    assert not (reference.train_dir / "save").exists()
    summary = json.loads((reference.train_dir / "summary.json").read_text())
    assert summary["ranks_agree"] and summary["steps"] == 8
    rows = read_metrics(reference.metrics)
    assert {"loss", "lr", "grad_norm", "samples_per_s", "step_time", "peak_memory_mb"} <= set(rows[0])
    assert {"eval_loss", "eval_loss_q0.1", "eval_loss_q0.9"} <= set(rows[-1])
    samples = sorted(p.name for p in (reference.train_dir / "samples").glob("*.png"))
    assert samples == ["step-000004.png", "step-000008.png"]
    assert Image.open(reference.train_dir / "samples" / samples[0]).size == (64, 32)
    assert all(r["grad_norm"] is not None and r["grad_norm"] > 0 for r in rows)


def test_golden_losses_and_lora(reference, golden):
    """The reference's 8 losses (LoRA dropout, cosine warm-up) and trained adapter equal the stored golden values."""
    golden("sd", "test_train_resume::reference", reference, lora_files=[reference.adapter_file])


def test_killed_mid_checkpoint_resumes_exactly(reference, tiny_run, cli, tmp_path):
    cfg = tiny_run.clone(tmp_path, **TRAIN)
    paths = RunPaths(tmp_path / "run")
    killed = cli("train", "-c", str(cfg), env={"DIFFPIPE_FAULT": "checkpoint-write:6"})
    assert killed.returncode == 17, killed.stderr[-3000:]
    assert [p.name for p in list_checkpoints(paths.checkpoints)] == ["step-000002", "step-000004"]
    assert (paths.checkpoints / ".tmp-step-000006").is_dir()  # the half-written one, never read

    # The resume and the refusal run in this process (the killed run had to be a process of its own).
    resumed = in_process("train", "-c", str(cfg), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 4" in resumed.stdout + resumed.stderr
    ref, got = read_metrics(reference.metrics), read_metrics(paths.metrics)
    assert [r["step"] for r in got] == list(range(1, 9))
    for a, b in zip(ref, got, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6, (a, b)
        assert a["lr"] == pytest.approx(b["lr"], abs=1e-12)
    assert abs(ref[-1]["eval_loss"] - got[-1]["eval_loss"]) <= 1e-6
    want, _ = load_adapter(reference.adapter_dir)
    have, _ = load_adapter(paths.adapter_dir)
    for k in want:
        torch.testing.assert_close(have[k], want[k], rtol=0, atol=1e-6)
    # Kept to the last 2, and the stale temporary folder is gone.
    assert sorted(p.name for p in paths.checkpoints.iterdir()) == ["step-000006", "step-000008"]

    # A changed config is refused, naming the keys; safe keys are not named.
    bad = tiny_run.config(paths.root, **{**TRAIN, "lr": 0.5, "checkpoint_every_steps": 3})
    bad["model"] = {"seed": 7}
    cfg.write_text(json.dumps(bad))
    refused = in_process("train", "-c", str(cfg), "--resume")
    assert refused.returncode == 2
    out = refused.stdout + refused.stderr
    assert "train.lr" in out and "model.seed" in out and "checkpoint_every_steps" not in out


def test_adapter_from_checkpoint(reference, tmp_path):
    out = adapter_from_checkpoint(reference.checkpoints / "step-000004", tmp_path / "lora")
    got, cfg = load_adapter(out)
    epoch1, _ = load_adapter(reference.epoch_loras / "epoch-0001")  # step 4 ends epoch 1
    assert cfg.r == 4 and cfg.lora_alpha == 8
    for k in epoch1:
        torch.testing.assert_close(got[k], epoch1[k], rtol=0, atol=0)
    # The checkpoints folder means its latest checkpoint.
    latest, _ = load_adapter(adapter_from_checkpoint(reference.checkpoints, tmp_path / "latest"))
    final, _ = load_adapter(reference.adapter_dir)
    assert all(torch.equal(latest[k], final[k]) for k in final)
    with pytest.raises(FileNotFoundError, match="not a complete diffpipe checkpoint"):
        adapter_from_checkpoint(tmp_path, tmp_path / "x")
