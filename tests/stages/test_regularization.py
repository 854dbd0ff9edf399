"""``datasets[].role: regularization`` and ``loss_weight``: the weighted loss and its separate logging.

A tiny-SD run over two datasets (the demo images, and a copy as a prior-preservation set weighted 0.5):
the batch loss equals the hand-computed weighted mean of the per-item losses at fixed draws, and the run
logs ``loss_train`` and ``loss_reg`` beside ``loss``.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import yaml

from diffpipe import stages
from diffpipe.config import ObjectiveConfig, load_config
from diffpipe.data.cache.reader import CachedDataset
from diffpipe.models import get_family
from diffpipe.paths import RunPaths
from diffpipe.training.loop import weighted_loss
from diffpipe.training.metrics import read_metrics

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tiny_run, cli, tmp_path_factory):
    root = tmp_path_factory.mktemp("reg")
    shutil.copytree(tiny_run.root / "data", root / "class_images")
    data = tiny_run.config(root / "run", max_steps=3, eval={"quantiles": []})
    data["datasets"].append({"name": "prior", "path": str(root / "class_images"), "resolution": 32,
                             "role": "regularization", "loss_weight": 0.5})
    cfg = root / "config.yaml"
    cfg.write_text(yaml.safe_dump(data))
    config = load_config(cfg)
    stages.prepare_data(config, RunPaths(config.output_dir))
    result = cli("train", "-c", str(cfg))
    assert result.returncode == 0, result.stderr[-3000:]
    return config, RunPaths(config.output_dir)


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
