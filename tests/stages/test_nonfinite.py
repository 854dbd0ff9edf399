"""Non-finite training is never saved (issue #38, case 2), on the tiny model through the real loop.

- A diverging run (``train.lr: 1.0e+6``: the loss is NaN from step 2) skips each NaN step with a
  counted warning, stops with an error naming the step after ``train.max_nonfinite_steps`` in a row
  (exit 1), and leaves its last finite checkpoint as the newest: no checkpoint is written in the streak.
- A run whose data holds one NaN item skips the steps that draw it and finishes, counting them in
  ``metrics.jsonl`` and ``summary.json``; its adapter is finite.
- Weights that are not finite (a checkpoint with a NaN planted, resumed) are never written: the
  checkpoint and the LoRA are refused, naming the tensor.
- ``export`` and ``sample`` refuse an adapter with a NaN planted in one tensor, naming it.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from stage_cli import in_process, rendezvous
from typer.testing import CliRunner

from diffpipe.cli import app
from diffpipe.config import load_config
from diffpipe.data.cache.reader import CachedDataset
from diffpipe.paths import RunPaths
from diffpipe.training.adapter import WEIGHTS_NAME, load_adapter
from diffpipe.training.checkpoint import ADAPTER_NAME, list_checkpoints
from diffpipe.training.metrics import read_metrics

TRAIN = {"max_steps": 8, "checkpoint_every_steps": 1, "keep_checkpoints": 1, "save_every_epochs": 0,
         "eval": {"quantiles": []}}


def _finite(sd: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in sd.values())


def test_diverging_run_skips_then_stops_keeping_its_last_finite_checkpoint(tiny_run, tmp_path):
    cfg = tiny_run.clone(tmp_path, **TRAIN, lr=1.0e6, max_nonfinite_steps=3)
    result = in_process("train", "-c", str(cfg))
    out = result.stdout + result.stderr
    assert result.returncode == 1, out[-3000:]
    # (a) each skipped step is warned about, counted
    assert "step 2: loss nan" in out and "(1 in a row, 1 in this run" in out
    assert "step 3: loss nan" in out and "(2 in a row, 2 in this run" in out
    # (b) the third in a row stops the run, naming the steps
    assert "stopped at step 4: 3 optimizer steps in a row (steps 2-4)" in out
    assert "Traceback" not in out
    paths = RunPaths(tmp_path / "run")
    rows = read_metrics(paths.metrics)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["skipped_steps"] for r in rows] == [0, 1, 2, 3]
    # (c) step 1's checkpoint (finite) stays the newest; nothing was exported
    ckpts = list_checkpoints(paths.checkpoints)
    assert [p.name for p in ckpts] == ["step-000001"]
    assert _finite(load_adapter(ckpts[0] / "adapter")[0])
    assert str(ckpts[0]) in out
    assert not paths.adapter_dir.exists()


@pytest.fixture(scope="module")
def nan_item_run(tiny_run, tmp_path_factory):
    """A run over the tiny data with one item's cached latents NaN: the steps that draw it are skipped."""
    from diffpipe.training.loop import train

    root = tmp_path_factory.mktemp("nan-item")
    cfg_file = tiny_run.clone(root, epochs=2, save_every_epochs=0, eval={"quantiles": []},
                              checkpoint_every_steps=1, keep_checkpoints=0)
    cfg, paths = load_config(cfg_file), RunPaths(root / "run")
    data = CachedDataset.from_run(paths)
    bad = data.items[3]
    data._latents[bad.bucket][bad.row] = math.nan  # what a corrupt cache entry would hand the loop
    lines: list[str] = []
    monkeypatch = rendezvous()
    try:
        result = train(cfg, paths, log=lines.append, data=data)
    finally:
        monkeypatch.undo()
    return cfg_file, paths, result, lines, data


def test_nan_items_skip_their_steps_and_the_run_finishes(nan_item_run):
    _, paths, result, lines, _ = nan_item_run
    rows = read_metrics(paths.metrics)
    skipped = [r["step"] for r in rows if not math.isfinite(r["loss"])]
    assert len(skipped) == 2 and result.skipped_steps == 2  # the item is drawn once per epoch
    assert rows[-1]["skipped_steps"] == 2
    assert json.loads((paths.train_dir / "summary.json").read_text())["skipped_steps"] == 2
    warnings = [line for line in lines if "optimizer step was skipped" in line]
    assert [f"step {s}:" in w for s, w in zip(skipped, warnings, strict=True)] == [True, True]
    assert math.isfinite(result.last_loss) or rows[-1]["step"] in skipped
    assert _finite(load_adapter(paths.adapter_dir)[0])


def test_resume_after_a_skipped_step_is_exact(nan_item_run, tmp_path, monkeypatch):
    """The skip count is part of the checkpoint: resumed just after a skipped step, the run logs the same
    losses and counts and ends with the same LoRA as the uninterrupted one."""
    from diffpipe.training.loop import train

    cfg_file, paths, _, _, data = nan_item_run
    rows = read_metrics(paths.metrics)
    after = next(r["step"] for r in rows if not math.isfinite(r["loss"])) + 1
    shutil.copytree(paths.root, tmp_path / "run")
    copy = RunPaths(tmp_path / "run")
    for ckpt in list_checkpoints(copy.checkpoints):
        if int(ckpt.name.removeprefix("step-")) > after:
            shutil.rmtree(ckpt)
    shutil.rmtree(copy.adapter_dir)
    cfg = load_config(cfg_file).model_copy(update={"output_dir": str(copy.root)})
    rendezvous(monkeypatch)
    train(cfg, copy, resume=True, log=lambda *_: None, data=data)
    again = read_metrics(copy.metrics)
    def pick(rs):  # as JSON text: NaN losses compare equal
        return json.dumps([[r["step"], r["loss"], r["skipped_steps"]] for r in rs])

    assert pick(again) == pick(rows)
    a, b = load_file(str(copy.adapter_dir / WEIGHTS_NAME)), load_file(str(paths.adapter_dir / WEIGHTS_NAME))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_nonfinite_weights_are_never_written(tiny_run, tmp_path):
    """Resuming a checkpoint whose weights hold a NaN (as an older diffpipe kept training through one):
    every step is skipped, and the end of the run refuses to write its checkpoint or LoRA, naming the
    tensor, so the finite step-6 checkpoint of the first run stays the newest (and is not replaced)."""
    from diffpipe.training.engine import deepspeed_safe_types

    cfg = tiny_run.clone(tmp_path, **{**TRAIN, "max_steps": 6, "checkpoint_every_steps": 2, "keep_checkpoints": 0})
    assert in_process("train", "-c", str(cfg)).returncode == 0
    paths = RunPaths(tmp_path / "run")
    states = paths.checkpoints / "step-000004" / "mp_rank_00_model_states.pt"
    with torch.serialization.safe_globals(deepspeed_safe_types()):
        saved = torch.load(states, weights_only=True)
    key = sorted(k for k in saved["module"] if "lora_B" in k)[0]
    saved["module"][key][0] = math.nan
    torch.save(saved, states)
    before = (paths.checkpoints / "step-000006" / "adapter" / WEIGHTS_NAME).read_bytes()
    result = in_process("train", "-c", str(cfg), "--checkpoint", "step-000004")
    out = result.stdout + result.stderr
    assert result.returncode == 1, out[-3000:]
    assert "step 5: loss nan" in out and "step 6: loss nan" in out
    assert "step 6:" in out and key.removesuffix(".weight") in out and "checkpoint step-000006 was not written" in out
    assert (paths.checkpoints / "step-000006" / "adapter" / WEIGHTS_NAME).read_bytes() == before
    assert _finite(load_adapter(paths.adapter_dir)[0])  # the first run's LoRA, not replaced


def _plant_nan(file, key_part: str) -> str:
    """A NaN in the first tensor whose name holds ``key_part`` (the header kept); returns its name."""
    with safe_open(str(file), framework="pt") as f:
        header = f.metadata()
    tensors = load_file(str(file))
    key = sorted(k for k in tensors if key_part in k)[0]
    tensors[key][0] = math.nan
    save_file(tensors, str(file), metadata=header)
    return key


def _fails(*args, cwd, monkeypatch) -> str:
    monkeypatch.chdir(cwd)
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 1, result.output
    return result.output


def test_export_and_sample_refuse_a_nonfinite_adapter(nan_item_run, tmp_path, monkeypatch):
    cfg_file, paths, *_ = nan_item_run
    # A diffusers file exported from the (finite) adapter, then a NaN planted in one of its tensors.
    good = tmp_path / "good"
    CliRunner().invoke(app, ["export", "-c", str(cfg_file), "-f", "diffusers", "--out", str(good)])
    lora_file = good / "pytorch_lora_weights.safetensors"
    key = _plant_nan(lora_file, "lora_B")
    out = _fails("sample", "-c", str(cfg_file), "--lora", str(lora_file), "--out", str(tmp_path / "s1"),
                 cwd=tmp_path, monkeypatch=monkeypatch)
    assert key in out and "NaN or inf" in out and not (tmp_path / "s1").exists()
    # The run's PEFT adapter with a NaN: export refuses it (nothing written), and so does sample.
    adapter = tmp_path / "adapter"
    shutil.copytree(paths.adapter_dir, adapter)
    key = _plant_nan(adapter / WEIGHTS_NAME, "lora_A")
    out = _fails("export", str(adapter), "-c", str(cfg_file), "--out", str(tmp_path / "e"),
                 cwd=tmp_path, monkeypatch=monkeypatch)
    assert key.removeprefix("base_model.model.") in out and not (tmp_path / "e").exists()
    out = _fails("sample", "-c", str(cfg_file), "--lora", str(adapter), "--out", str(tmp_path / "s2"),
                 cwd=tmp_path, monkeypatch=monkeypatch)
    assert key in out and not (tmp_path / "s2").exists()
    # A checkpoint whose LoRA holds a NaN: `export CHECKPOINT` refuses it before copying its adapter out.
    ckpt = tmp_path / "ckpts" / "step-000001"
    shutil.copytree(list_checkpoints(paths.checkpoints)[0], ckpt)
    key = _plant_nan(ckpt / ADAPTER_NAME / WEIGHTS_NAME, "lora_B")
    out = _fails("export", str(ckpt), "--out", str(tmp_path / "e2"), cwd=tmp_path, monkeypatch=monkeypatch)
    assert key.removeprefix("base_model.model.") in out and not (tmp_path / "e2").exists()
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["step-000001"]  # no .adapter-* copy left
    assert yaml.safe_load(cfg_file.read_text())  # the config is untouched
