"""Eval loss at fixed timestep quantiles: repeatable, and it moves when the weights do."""

import torch

from diffpipe.config import EvalConfig, ModelConfig
from diffpipe.data.cache.reader import CachedDataset
from diffpipe.families import get_family
from diffpipe.paths import RunPaths
from diffpipe.training.eval import Evaluator, eval_batches


def test_eval_is_fixed_and_sensitive(tiny_run):
    data = CachedDataset.from_run(RunPaths(tiny_run.root / "run"))
    family = get_family(ModelConfig())
    unet = family.load_denoiser()
    cfg = EvalConfig(quantiles=[0.1, 0.5, 0.9], max_items=3)
    assert sum(len(b) for b in eval_batches(data, 3, 2)) == 3
    first = Evaluator(family, data, cfg, batch_size=2, device=torch.device("cpu"))(unet)
    again = Evaluator(family, data, cfg, batch_size=2, device=torch.device("cpu"))(unet)
    assert set(first) == {"eval_loss_q0.1", "eval_loss_q0.5", "eval_loss_q0.9", "eval_loss"}
    assert first == again
    assert first["eval_loss"] == sum(first[f"eval_loss_q{q}"] for q in (0.1, 0.5, 0.9)) / 3
    with torch.no_grad():
        unet.conv_out.weight.mul_(1.5)
    assert Evaluator(family, data, cfg, batch_size=2, device=torch.device("cpu"))(unet) != first
