"""``train.ema``: the average of the trained LoRA weights, its exact resume, its export and its card.

One tiny-SD run of 4 steps with a checkpoint after every step (each holds the raw weights of its step),
and the same run killed after step 2 and resumed. The average is recomputed by hand from the recorded
``lora_B`` weights (zero at initialisation) with EMAModel's decays: 0, then ``t / (9 + t)`` at update ``t``.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import StableDiffusionPipeline
from stage_cli import in_process

from diffpipe.config import load_config, parse_config
from diffpipe.families import get_family
from diffpipe.paths import RunPaths
from diffpipe.training.adapter import load_adapter
from diffpipe.training.checkpoint import list_checkpoints

pytestmark = pytest.mark.slow

TRAIN = {"max_steps": 4, "checkpoint_every_steps": 1, "keep_checkpoints": 0, "lr": 0.02,
         "eval": {"quantiles": []}, "ema": {"enabled": True, "decay": 0.9}}


@pytest.fixture(scope="module")
def run(tiny_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("ema")
    cfg = tiny_run.clone(root, **TRAIN)
    result = in_process("train", "-c", str(cfg))
    assert result.returncode == 0, result.stderr[-3000:]
    return RunPaths(root / "run"), cfg


def _hand_ema(paths: RunPaths) -> dict[str, torch.Tensor]:
    steps = [load_adapter(c / "adapter")[0] for c in list_checkpoints(paths.checkpoints)]
    assert len(steps) == 4
    avg = {k: torch.zeros_like(v) for k, v in steps[0].items() if "lora_B" in k}
    for t, weights in enumerate(steps, start=1):
        d = 0.0 if t == 1 else min(0.9, t / (9 + t))
        avg = {k: d * avg[k] + (1 - d) * weights[k].float() for k in avg}
    return avg


def test_the_adapter_is_the_hand_computed_average_and_the_raw_weights_are_beside_it(run):
    paths, _ = run
    ema, _ = load_adapter(paths.adapter_dir)
    raw, _ = load_adapter(paths.train_dir / "adapter_raw")
    last, _ = load_adapter(list_checkpoints(paths.checkpoints)[-1] / "adapter")
    for k, v in _hand_ema(paths).items():
        torch.testing.assert_close(ema[k], v, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(raw[k], last[k], rtol=0, atol=0)
        assert not torch.allclose(ema[k], raw[k])
    assert all((c / "ema.safetensors").is_file() for c in list_checkpoints(paths.checkpoints))


def test_resume_is_exact(run, tiny_run, cli, tmp_path):
    paths, _ = run
    cfg = tiny_run.clone(tmp_path, **TRAIN)
    killed = cli("train", "-c", str(cfg), env={"DIFFPIPE_FAULT": "after-step:2"})
    assert killed.returncode == 17, killed.stderr[-3000:]
    resumed = in_process("train", "-c", str(cfg), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, _ = load_adapter(paths.adapter_dir)
    have, _ = load_adapter(RunPaths(tmp_path / "run").adapter_dir)
    for k in want:
        torch.testing.assert_close(have[k], want[k], rtol=0, atol=1e-7)


def test_the_average_exports_loads_in_the_stock_pipeline_and_says_so(run):
    paths, cfg_file = run
    result = in_process("export", "-c", str(cfg_file))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "exponential moving average of the trained weights (decay 0.9)" in (paths.export_dir / "README.md").read_text()
    family = get_family(load_config(cfg_file).model)
    x = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    t, text = torch.tensor([500]), torch.randn(1, 77, 32, generator=torch.Generator().manual_seed(1))
    outs = []
    for lora in (None, paths.export_diffusers):
        pipe: StableDiffusionPipeline = family.load_pipeline()
        if lora is not None:
            pipe.load_lora_weights(str(lora))
        with torch.no_grad():
            outs.append(pipe.unet(x, t, text).sample)
    assert (outs[0] - outs[1]).abs().max() > 1e-6


def test_config_refuses_what_it_cannot_average():
    for bad in ({"zero_stage": 3}, {"pipeline_stages": 2}, {"mode": "full"}):
        with pytest.raises(ValueError, match="train.ema needs"):
            parse_config({"datasets": [{"name": "d", "path": "data"}], "train": {"ema": {"enabled": True}, **bad}})
