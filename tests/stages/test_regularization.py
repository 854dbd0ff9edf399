"""``datasets[].role: regularization`` and ``loss_weight``: the weighted loss and its separate logging.

A tiny-SD run over two datasets (the demo images, and a copy as a prior-preservation set weighted 0.5):
the batch loss equals the hand-computed weighted mean of the per-item losses at fixed draws, and the run
logs ``loss_train`` and ``loss_reg`` beside ``loss``. With ``prior_target: base`` (output preservation) the
prior set trains towards the base model's prediction.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import yaml
from stage_cli import in_process

from diffpipe import stages
from diffpipe.config import ObjectiveConfig, load_config
from diffpipe.data.cache.reader import CachedDataset
from diffpipe.families import get_family
from diffpipe.paths import RunPaths
from diffpipe.training.loop import weighted_loss
from diffpipe.training.metrics import read_metrics

pytestmark = pytest.mark.slow


def _train_with_prior(tiny_run, root, max_steps: int, **prior):
    """The demo images plus a copy of them as a regularisation dataset (``prior`` settings), trained."""
    shutil.copytree(tiny_run.root / "data", root / "class_images")
    data = tiny_run.config(root / "run", max_steps=max_steps, eval={"quantiles": []})
    data["datasets"].append({"name": "prior", "path": str(root / "class_images"), "resolution": 32,
                             "role": "regularization", **prior})
    cfg = root / "config.yaml"
    cfg.write_text(yaml.safe_dump(data))
    config = load_config(cfg)
    stages.prepare_data(config, RunPaths(config.output_dir))
    result = in_process("train", "-c", str(cfg))
    assert result.returncode == 0, result.stderr[-3000:]
    return config, RunPaths(config.output_dir)


@pytest.fixture(scope="module")
def run(tiny_run, tmp_path_factory):
    return _train_with_prior(tiny_run, tmp_path_factory.mktemp("reg"), 3, loss_weight=0.5)


def test_the_batch_loss_is_the_weighted_mean_of_the_item_losses(run):
    config, paths = run
    data = CachedDataset.from_run(paths)
    reg = [i for i, it in enumerate(data.items) if it.regularization]
    plain = [i for i, it in enumerate(data.items) if not it.regularization and it.bucket == data.items[reg[0]].bucket]
    assert reg and plain and all(data.items[i].loss_weight == 0.5 for i in reg)
    batch = data.collate([plain[0], reg[0]])
    family = get_family(config.model)
    unet = family.load_denoiser()
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        per_item = family.loss(unet, batch["latents"], batch["text"], torch.Generator(), t=torch.tensor([0.3, 0.6]),
                               noise=noise, objective=ObjectiveConfig())
    parts = {"loss_train": [], "loss_reg": []}
    got = weighted_loss(per_item, batch, parts)
    torch.testing.assert_close(got, (per_item[0] * 1.0 + per_item[1] * 0.5) / 2)
    torch.testing.assert_close(parts["loss_reg"][0], per_item[1:])
    torch.testing.assert_close(parts["loss_train"][0], per_item[:1])


def test_the_run_logs_both_losses(run):
    _, paths = run
    rows = read_metrics(paths.metrics)
    assert len(rows) == 3
    assert all("loss_train" in r or "loss_reg" in r for r in rows)
    assert any("loss_reg" in r for r in rows)


@pytest.fixture(scope="module")
def base_target_run(tiny_run, tmp_path_factory):
    """The same two datasets, the prior set with ``prior_target: base`` (output preservation)."""
    return _train_with_prior(tiny_run, tmp_path_factory.mktemp("preserve"), 8, prior_target="base")


def test_base_target_items_train_towards_the_base_models_prediction(base_target_run):
    from diffpipe.training.adapter import apply_adapter

    config, paths = base_target_run
    rows = read_metrics(paths.metrics)
    reg_rows = [r["loss_reg"] for r in rows if "loss_reg" in r]
    # The LoRA starts as the identity (B = 0): until it has moved, the preserved items have nothing to learn.
    assert "loss_reg" in rows[0] and rows[0]["loss_reg"] == 0.0, rows[0]
    assert len(reg_rows) > 1 and max(reg_rows[1:]) > 0  # once the LoRA moved, the base prediction is a target

    data = CachedDataset.from_run(paths)
    reg = [i for i, it in enumerate(data.items) if it.regularization]
    plain = [i for i, it in enumerate(data.items) if not it.regularization and it.bucket == data.items[reg[0]].bucket]
    assert all(data.items[i].base_target for i in reg) and not any(data.items[i].base_target for i in plain)
    batch = data.collate([plain[0], reg[0]])
    assert batch["base_target"].tolist() == [False, True]
    family = get_family(config.model)
    base, trained = family.load_denoiser(), apply_adapter(family.load_denoiser(), paths.adapter_dir)
    t = torch.tensor([0.3, 0.6])
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = family.loss(trained, batch["latents"], batch["text"], torch.Generator(), t=t, noise=noise,
                          base_target=batch["base_target"])
        prepared = family.prepare(batch["latents"], batch["text"], torch.Generator(), objective=ObjectiveConfig(),
                                  t=t, noise=noise)
        pred, pred_base = family.predict(trained, prepared), family.predict(base, prepared)
    # By hand: the plain item against its data target, the preserved one against the base model's output.
    want = torch.stack([((pred[0] - prepared.target[0]) ** 2).mean(), ((pred[1] - pred_base[1]) ** 2).mean()])
    torch.testing.assert_close(got, want)
    assert got[1] > 0 and all(p.requires_grad for n, p in trained.named_parameters() if "lora_" in n)


def test_base_target_settings_are_checked(tiny_run, tmp_path):
    from diffpipe.config import Config

    data = tiny_run.config(tmp_path / "run")
    data["datasets"].append({"name": "prior", "path": data["datasets"][0]["path"], "resolution": 32,
                             "prior_target": "base"})
    with pytest.raises(ValueError, match=r"prior_target base needs datasets\[1\].role: regularization"):
        Config.model_validate(data)
    data["datasets"][1]["role"] = "regularization"
    data["train"]["mode"] = "full"
    with pytest.raises(ValueError, match="needs train.mode lora"):
        Config.model_validate(data)
