"""The Flux-style family through every real stage, run one by one through the CLI.

validate → plan → cache latents/text → 2 DeepSpeed steps → diffusers export →
load into the stock FluxPipeline → output changes and matches the trained
transformer → sampling runs. (The SD family gets the same proof from the
Snakemake workflow test.)

The run's losses and exported LoRA are also compared with the golden values in
``tests/assets/golden_losses.json``; ``DIFFPIPE_UPDATE_GOLDEN=1`` rewrites them
deliberately (see ``tests/golden.py``).
"""

from __future__ import annotations

import shutil

import pytest
import torch
import yaml
from stage_cli import rendezvous, run_stages

from diffpipe.config import load_config
from diffpipe.families import get_family
from diffpipe.paths import REPO_ROOT, RunPaths
from diffpipe.training.adapter import apply_adapter

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def flux_run(tmp_path_factory):
    monkeypatch = rendezvous()  # undone after the module
    root = tmp_path_factory.mktemp("flux")
    shutil.copytree(REPO_ROOT / "config" / "demo_data", root / "data")
    cfg = {
        "output_dir": "run",
        "model": {"family": "flux", "flavor": "tiny"},
        "datasets": [{"name": "shapes", "path": str(root / "data"), "resolution": 64}],
        "cache": {"shards": 1},
        "train": {"max_steps": 2, "batch_size": 2, "lr": 0.01, "save_every_epochs": 0},
        "sample": {"prompts": ["a red circle"], "steps": 2},
    }
    config = root / "flux.yaml"
    config.write_text(yaml.safe_dump(cfg))
    c = str(config)
    paths = RunPaths(root / "run")
    run_stages(c, cwd=root, monkeypatch=monkeypatch)
    monkeypatch.undo()
    return load_config(config), paths


def test_flux_stages_write_their_outputs(flux_run):
    _, p = flux_run
    for f in [p.manifest, p.adapter_file, p.metrics, p.export_diffusers, p.sample_grid]:
        assert f.exists(), f
    assert len(p.metrics.read_text().splitlines()) == 2


def test_flux_golden_losses_and_lora(flux_run, golden):
    """The 2 losses and the exported LoRA equal the stored golden values (tests/golden.py)."""
    _, p = flux_run
    golden("flux", "test_flux_end_to_end::flux_run", p)


def test_flux_lora_loads_in_stock_pipeline_and_matches_training(flux_run):
    cfg, p = flux_run
    family = get_family(cfg.model)
    pipe = family.load_pipeline()
    tr = pipe.transformer
    g = torch.Generator().manual_seed(0)
    seq, txt = 16, 8
    kwargs = dict(
        hidden_states=torch.randn(1, seq, tr.config.in_channels, generator=g),
        encoder_hidden_states=torch.randn(1, txt, tr.config.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(1, tr.config.pooled_projection_dim, generator=g),
        timestep=torch.tensor([0.5]),
        img_ids=torch.zeros(seq, 3),
        txt_ids=torch.zeros(txt, 3),
        guidance=torch.tensor([1.0]) if tr.config.guidance_embeds else None,
    )
    with torch.no_grad():
        base = tr(**kwargs).sample
        pipe.load_lora_weights(str(p.export_diffusers))
        loaded = pipe.transformer(**kwargs).sample
        expected = apply_adapter(family.load_denoiser(), p.adapter_dir)(**kwargs).sample
    assert (loaded - base).abs().max() > 1e-5, "the LoRA does not change the output"
    torch.testing.assert_close(loaded, expected, rtol=1e-5, atol=1e-5)
