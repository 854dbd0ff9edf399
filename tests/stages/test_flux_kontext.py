"""``flux-kontext`` on its tiny flavor: edit pairs (target + control image) through every real stage.

validate → plan → cache (targets and control latents) → 2 DeepSpeed steps →
diffusers export → sample, in-process through the Typer app. Then: the
reference tokens equal what ``FluxKontextPipeline.prepare_latents`` builds
from the same latents, the control image changes the loss, and the exported
LoRA loads into the stock pipeline and reproduces the trained adapter.

The run's losses and exported LoRA are also compared with the golden values in
``tests/assets/golden_losses.json``; ``DIFFPIPE_UPDATE_GOLDEN=1`` rewrites them
deliberately (see ``tests/golden.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml
from diffusers import FluxKontextPipeline
from PIL import Image
from stage_cli import rendezvous, run_stages

from diffpipe.config import load_config
from diffpipe.data.cache.reader import CachedDataset
from diffpipe.data.dataset.demo import write_demo_dataset
from diffpipe.families import get_family
from diffpipe.families.flux_kontext.family import reference_tokens
from diffpipe.paths import RunPaths
from diffpipe.training.adapter import apply_adapter

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("kontext")
    write_demo_dataset(root / "data", n=4, size=32)
    (root / "controls").mkdir()
    for i in range(4):  # the "before" image of each edit: the target's colours inverted
        img = np.asarray(Image.open(root / "data" / f"shape_{i:03d}.png").convert("RGB"))
        Image.fromarray(255 - img).save(root / "controls" / f"shape_{i:03d}.png")
    cfg = {
        "output_dir": "run",
        "model": {"family": "flux-kontext", "flavor": "tiny"},
        "datasets": [{"name": "edits", "path": str(root / "data"), "control_path": str(root / "controls"),
                      "resolution": 32}],
        "cache": {"shards": 1, "workers": 0},
        "train": {"max_steps": 2, "batch_size": 2, "lr": 0.01, "save_every_epochs": 0, "eval": {"quantiles": []}},
        "export": {"formats": ["diffusers"]},
        "sample": {"prompts": ["make it red"], "steps": 2, "width": 32, "height": 32},
    }
    config = root / "kontext.yaml"
    config.write_text(yaml.safe_dump(cfg))
    c = str(config)
    monkeypatch = rendezvous()
    try:
        paths = RunPaths(root / "run")
        run_stages(c, cwd=root, monkeypatch=monkeypatch)
    finally:
        monkeypatch.undo()
    return load_config(config), paths


def test_stages_write_their_outputs(run):
    _, p = run
    for f in [p.adapter_file, p.metrics, p.export_diffusers, p.sample_grid]:
        assert f.exists(), f
    assert len(p.metrics.read_text().splitlines()) == 2


def test_golden_losses_and_lora(run, golden):
    """The 2 losses and the exported LoRA equal the stored golden values (tests/golden.py)."""
    _, p = run
    golden("flux-kontext", "test_flux_kontext::run", p)


def test_reference_tokens_are_the_pipelines(run):
    cfg, p = run
    family = get_family(cfg.model)
    batch = CachedDataset.from_run(p).collate([0, 1])
    control = batch["control_latents"][:, :, 0]
    tokens, ids = reference_tokens(control)
    pipe = family.load_pipeline()
    _, image_latents, _, image_ids = pipe.prepare_latents(
        control, 2, pipe.transformer.config.in_channels // 4, 32, 32, torch.float32, torch.device("cpu"),
        torch.Generator().manual_seed(0))
    torch.testing.assert_close(tokens, image_latents)
    torch.testing.assert_close(ids, image_ids)


def _outputs(family, denoiser, batch, control=None):
    """The transformer's input length, raw output and the loss, at fixed t and noise."""
    seen = []
    handle = denoiser.register_forward_hook(lambda m, a, kw, o: seen.append((kw["hidden_states"].shape[1], o[0])),
                                            with_kwargs=True)
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            loss = family.loss(denoiser, batch["latents"], batch["text"], torch.Generator(),
                               t=torch.tensor([0.3, 0.7]), noise=noise,
                               control=batch["control_latents"] if control is None else control)
    finally:
        handle.remove()
    return seen[0][0], seen[0][1], loss


def test_loss_sees_the_control_and_the_lora_loads_in_the_stock_pipeline(run):
    cfg, p = run
    family = get_family(cfg.model)
    batch = CachedDataset.from_run(p).collate([0, 1])
    h, w = batch["latents"].shape[-2:]
    target_tokens = (h // 2) * (w // 2)
    pipe = family.load_pipeline()
    assert isinstance(pipe, FluxKontextPipeline)
    length, base, loss = _outputs(family, pipe.transformer, batch)
    assert length == 2 * target_tokens  # the target's tokens, then the reference's
    _, _, other = _outputs(family, pipe.transformer, batch, control=torch.zeros_like(batch["control_latents"]))
    assert not torch.allclose(loss, other)  # the control image conditions the prediction
    pipe.load_lora_weights(str(p.export_diffusers))
    _, loaded, _ = _outputs(family, pipe.transformer, batch)
    _, expected, _ = _outputs(family, apply_adapter(family.load_denoiser(), p.adapter_dir), batch)
    assert (loaded - base).abs().max() > 1e-5, "the LoRA does not change the output"
    torch.testing.assert_close(loaded, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="control"):
        family.loss(pipe.transformer, batch["latents"], batch["text"], torch.Generator())
