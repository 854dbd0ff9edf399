"""Every image family beyond ``sd``/``flux`` on its tiny flavor, through every real stage.

One parametrized module with shared set-up: validate → plan → cache latents
and text → 2 DeepSpeed steps → diffusers export → sample (the family's stock
pipeline renders), run in-process through the real Typer app as in
``test_flux_end_to_end.py``. Then the exported file is loaded into the stock
pipeline with ``load_lora_weights``: the denoiser's output changes and equals
the trained adapter's (allclose), measured on a cached batch through the
family's own loss.

The run's losses and exported LoRA are also compared with the golden values in
``tests/assets/golden_losses.json``; ``DIFFPIPE_UPDATE_GOLDEN=1`` rewrites them
deliberately (see ``tests/golden.py``).
"""

from __future__ import annotations

import shutil

import peft
import pytest
import torch
import yaml
from family_tables import image_families
from stage_cli import rendezvous, run_stages

from diffpipe.config import ModelConfig, load_config
from diffpipe.data.cache.reader import CachedDataset
from diffpipe.families import get_family
from diffpipe.paths import REPO_ROOT, RunPaths
from diffpipe.training.adapter import apply_adapter

pytestmark = pytest.mark.slow

#: Every registered image family but those with a module of their own (``tests/family_tables.py``).
FAMILIES = image_families()


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    shutil.copytree(REPO_ROOT / "config" / "demo_data", root / "data")
    return root / "data"


@pytest.fixture(scope="module", params=FAMILIES)
def run(request, demo_data, tmp_path_factory):
    name = request.param
    monkeypatch = rendezvous()
    root = tmp_path_factory.mktemp(name)
    cfg = {
        "output_dir": "run",
        "model": {"family": name, "flavor": "tiny"},
        "datasets": [{"name": "shapes", "path": str(demo_data), "resolution": 64}],
        "cache": {"shards": 1, "workers": 0},
        "train": {"max_steps": 2, "batch_size": 2, "lr": 0.01, "save_every_epochs": 0,
                  "eval": {"quantiles": []}},
        "export": {"formats": ["diffusers", "peft", "merged"]},
        "sample": {"prompts": ["a red circle"], "steps": 2},
    }
    config = root / f"{name}.yaml"
    config.write_text(yaml.safe_dump(cfg))
    c = str(config)
    try:
        paths = RunPaths(root / "run")
        run_stages(c, cwd=root, monkeypatch=monkeypatch)
    finally:
        monkeypatch.undo()
    return load_config(config), paths


def test_stages_write_their_outputs(run):
    _, p = run
    for f in [p.manifest, p.adapter_file, p.metrics, p.export_diffusers, p.sample_grid]:
        assert f.exists(), f
    assert len(p.metrics.read_text().splitlines()) == 2


def test_golden_losses_and_lora(run, golden):
    """The 2 losses and the exported LoRA equal the stored golden values (tests/golden.py)."""
    cfg, p = run
    golden(cfg.model.family, "test_image_families::run", p)


def _denoiser_output(family, denoiser, batch) -> torch.Tensor:
    """The denoiser's raw output on a cached batch, fixed t and noise, through the family's loss."""
    out = []

    def keep(module, args, output):
        o = output[0] if isinstance(output, tuple) else output.sample
        out.append(torch.stack(o) if isinstance(o, list) else o)  # Z-Image: one output per image

    handle = denoiser.register_forward_hook(keep)
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            family.loss(denoiser, batch["latents"], batch["text"], torch.Generator(),
                        t=torch.tensor([0.3, 0.7]), noise=noise)
    finally:
        handle.remove()
    return out[0]


def test_lora_loads_in_stock_pipeline_and_matches_training(run):
    cfg, p = run
    family = get_family(cfg.model)
    batch = CachedDataset.from_run(p).collate([0, 1])
    pipe = family.load_pipeline()
    assert isinstance(pipe, family.pipeline_class)
    base = _denoiser_output(family, getattr(pipe, family.denoiser_name), batch)
    family.load_lora(pipe, p.export_diffusers)
    loaded = _denoiser_output(family, getattr(pipe, family.denoiser_name), batch)
    expected = _denoiser_output(family, apply_adapter(family.load_denoiser(), p.adapter_dir), batch)
    assert (loaded - base).abs().max() > 1e-5, "the LoRA does not change the output"
    torch.testing.assert_close(loaded, expected, rtol=1e-5, atol=1e-5)

    # The other generic formats: the PEFT folder and the merged pipeline reproduce it too.
    peft_denoiser = family.load_denoiser()
    peft.PeftModel.from_pretrained(peft_denoiser, str(p.export_file("peft")))  # injects into peft_denoiser
    torch.testing.assert_close(_denoiser_output(family, peft_denoiser, batch), expected, rtol=1e-5, atol=1e-5)
    # Cosmos2: the stock pipeline's safety checker is passed explicitly (see diffpipe.families.cosmos2.family).
    extra = {"safety_checker": family.safety_checker()} if family.name == "cosmos2" else {}
    merged = family.pipeline_class.from_pretrained(str(p.export_file("merged")), **extra)
    torch.testing.assert_close(_denoiser_output(family, getattr(merged, family.denoiser_name), batch), expected,
                               rtol=1e-4, atol=1e-4)


def test_local_flavor_loads_the_saved_pipeline(run, tmp_path):
    cfg, _ = run
    family = get_family(cfg.model)
    family.load_pipeline().save_pretrained(tmp_path)
    local = get_family(ModelConfig(family=family.name, flavor="local", path=str(tmp_path)))
    assert local.vae_identity() == family.vae_identity()
    assert local.text_identity() == family.text_identity()
    a = family.load_denoiser().state_dict()
    b = local.load_denoiser().state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if family.name == "kandinsky5-image":  # the folder's pipeline names the family, not the video one
        with pytest.raises(ValueError, match="names a kandinsky5-image pipeline; set model.family: kandinsky5-image"):
            get_family(ModelConfig(family="kandinsky5", flavor="local", path=str(tmp_path)))
