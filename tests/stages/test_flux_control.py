"""``flux-control`` on its tiny flavor: control-image pairs through every real stage.

validate → plan → cache (targets and control latents) → 2 DeepSpeed steps → diffusers, peft and merged
export → sample with the control image. Then: the training input is what ``FluxControlPipeline`` builds
(noisy latents and control latents, packed, concatenated along the channels), the widened input layer
starts as the stock one (zero control weights), the control image changes the trained model's loss, and
the exported LoRA widens a stock transformer in ``FluxControlPipeline.load_lora_weights`` and reproduces
the trained model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FluxControlPipeline
from PIL import Image
from stage_cli import run_config

from diffpipe.config import load_config
from diffpipe.data.cache.reader import CachedDataset
from diffpipe.data.dataset.demo import write_demo_dataset
from diffpipe.families import get_family
from diffpipe.families.flux.family import FluxFamily
from diffpipe.paths import RunPaths
from diffpipe.training.adapter import apply_adapter

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("control")
    write_demo_dataset(root / "data", n=4, size=32)
    (root / "controls").mkdir()
    for i in range(4):  # an "edge map" of each target: its grey levels thresholded
        img = np.asarray(Image.open(root / "data" / f"shape_{i:03d}.png").convert("L"))
        Image.fromarray(((img > 128) * 255).astype(np.uint8)).convert("RGB").save(root / "controls" / f"shape_{i:03d}.png")
    cfg = {
        "output_dir": "run",
        "model": {"family": "flux-control", "flavor": "tiny"},
        "datasets": [{"name": "pairs", "path": str(root / "data"), "control_path": str(root / "controls"),
                      "resolution": 32}],
        "cache": {"shards": 1, "workers": 0},
        "train": {"max_steps": 2, "batch_size": 2, "lr": 0.01, "save_every_epochs": 0, "eval": {"quantiles": []}},
        "export": {"formats": ["diffusers", "peft", "merged"]},
        "sample": {"prompts": ["a circle"], "steps": 2, "width": 32, "height": 32,
                   "images": [str(root / "controls" / "shape_000.png")]},
    }
    return load_config(run_config(cfg, root, "control")), RunPaths(root / "run")


def test_stages_write_their_outputs(run):
    _, p = run
    for f in [p.adapter_file, p.metrics, p.export_diffusers, p.sample_grid]:
        assert f.exists(), f
    assert len(p.metrics.read_text().splitlines()) == 2


def test_golden_losses_and_lora(run, golden):
    """The 2 losses and the exported LoRA equal the stored golden values (tests/golden.py)."""
    _, p = run
    golden("flux-control", "test_flux_control::run", p)


def test_inputs_are_the_pipelines_and_the_wide_layer_starts_as_the_stock_one(run):
    cfg, p = run
    family = get_family(cfg.model)
    batch = CachedDataset.from_run(p).collate([0, 1])
    control = batch["control_latents"][:, :, 0]
    prepared = family.prepare(batch["latents"], batch["text"], torch.Generator().manual_seed(0),
                              objective=cfg.train.objective, control=batch["control_latents"])
    b, c, h, w = control.shape
    x = prepared.inputs["hidden_states"]
    torch.testing.assert_close(x[..., 4 * c:], FluxControlPipeline._pack_latents(control, b, c, h, w))
    stock, wide = FluxFamily.load_denoiser(family), family.load_denoiser()
    assert wide.x_embedder.in_features == 2 * stock.x_embedder.in_features == wide.config.in_channels
    assert wide.config.out_channels == stock.config.in_channels
    torch.testing.assert_close(wide.x_embedder.weight[:, : 4 * c], stock.x_embedder.weight)
    assert not wide.x_embedder.weight[:, 4 * c:].any()
    assert "x_embedder" in family.lora_targets(None)


def _prediction(family, denoiser, batch, control):
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        p = family.prepare(batch["latents"], batch["text"], torch.Generator(), objective=_objective(), t=torch.tensor([0.3, 0.7]), noise=noise, control=control)
        return family.predict(denoiser, p)


def _objective():
    from diffpipe.config import ObjectiveConfig

    return ObjectiveConfig()


def test_the_lora_uses_the_control_and_loads_in_the_stock_pipeline(run):
    cfg, p = run
    family = get_family(cfg.model)
    batch = CachedDataset.from_run(p).collate([0, 1])
    trained = apply_adapter(family.load_denoiser(), p.adapter_dir)
    with_control = _prediction(family, trained, batch, batch["control_latents"])
    without = _prediction(family, trained, batch, torch.zeros_like(batch["control_latents"]))
    assert (with_control - without).abs().max() > 1e-6, "the trained model ignores the control image"
    assert isinstance(family.load_pipeline(), FluxControlPipeline)
    pipe = family.load_pipeline()
    pipe.transformer = FluxFamily.load_denoiser(family)  # FLUX.1 [dev] as a user has it
    assert pipe.transformer.x_embedder.in_features == pipe.transformer.config.in_channels  # stock width
    pipe.load_lora_weights(str(p.export_diffusers))
    assert pipe.transformer.x_embedder.in_features == trained.x_embedder.in_features  # widened by the loader
    loaded = _prediction(family, pipe.transformer, batch, batch["control_latents"])
    torch.testing.assert_close(loaded, with_control, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="control"):
        family.loss(trained, batch["latents"], batch["text"], torch.Generator())


def test_pipeline_layers_reproduce_the_prediction(run):
    """Flux's layer list runs the widened model: the first layer embeds the concatenated channels."""
    from diffpipe.models.layers import run_layers

    cfg, p = run
    family = get_family(cfg.model)
    batch = CachedDataset.from_run(p).collate([0, 1])
    trained = apply_adapter(family.load_denoiser(), p.adapter_dir)
    prepared = family.prepare(batch["latents"], batch["text"], torch.Generator().manual_seed(1),
                              objective=_objective(), control=batch["control_latents"])
    with torch.no_grad():
        expected = family.predict(trained, prepared)
        got = run_layers(family.pipeline_layers(trained), family.layer_inputs(prepared))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
