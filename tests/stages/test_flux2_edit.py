"""FLUX.2 editing (``flux2-klein`` and ``flux2``, ``model.variant: edit``): two reference images per item.

validate → plan → cache (targets and both references' latents) → 2 DeepSpeed steps → diffusers export →
sample, in-process through the Typer app. Then, against the stock ``Flux2Pipeline``: the reference tokens
and positions equal what its first transformer call gets for the same images, each reference conditions
the loss, and the exported LoRA loads into the pipeline and reproduces the trained adapter. The losses and
the LoRA are golden (``tests/assets/golden_losses.json``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from stage_cli import run_config

from diffpipe.config import ModelConfig, load_config
from diffpipe.data.cache.reader import CachedDataset
from diffpipe.families import get_family
from diffpipe.families.flux2_klein.family import reference_tokens
from diffpipe.paths import RunPaths
from diffpipe.training.adapter import apply_adapter

pytestmark = pytest.mark.slow
SIZE = (96, 64)  # width, height: the pipeline takes references of 64 pixels a side or more


@pytest.fixture(scope="module", params=["flux2-klein", "flux2"])
def run(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"{request.param}-edit")
    rng = np.random.default_rng(0)
    for folder in ("data", "ref1", "ref2"):
        (root / folder).mkdir()
    for i in range(4):  # reference 1: the target inverted; reference 2: its channels swapped
        img = rng.integers(0, 256, (SIZE[1], SIZE[0], 3), dtype=np.uint8)
        Image.fromarray(img).save(root / "data" / f"item_{i}.png")
        (root / "data" / f"item_{i}.txt").write_text("put them together" if i % 2 else "swap the colours")
        Image.fromarray(255 - img).save(root / "ref1" / f"item_{i}.png")
        Image.fromarray(img[..., ::-1].copy()).save(root / "ref2" / f"item_{i}.png")
    cfg = {
        "output_dir": "run",
        "model": {"family": request.param, "flavor": "tiny", "variant": "edit"},
        "datasets": [{"name": "edits", "path": str(root / "data"),
                      "control_path": [str(root / "ref1"), str(root / "ref2")], "resolution": 64}],
        "cache": {"shards": 1, "workers": 0},
        "train": {"max_steps": 2, "batch_size": 2, "lr": 0.01, "save_every_epochs": 0, "eval": {"quantiles": []}},
        "export": {"formats": ["diffusers"]},
        "sample": {"prompts": ["swap the colours"], "steps": 2, "width": SIZE[0], "height": SIZE[1],
                   "images": [str(root / "ref1" / "item_0.png")]},
    }
    config = run_config(cfg, root, "flux2-edit")
    return load_config(config), RunPaths(root / "run"), root


def test_stages_write_their_outputs_and_golden(run, golden):
    cfg, p, _ = run
    for f in [p.adapter_file, p.metrics, p.export_diffusers, p.sample_grid]:
        assert f.exists(), f
    golden(cfg.model.family, "test_flux2_edit::run", p)


def test_reference_tokens_are_the_pipelines(run):
    """Both references' tokens and positions (time axis 10, 20) are those of the pipeline's first transformer
    call for the same two images; the target's come first."""
    cfg, _, root = run
    family = get_family(cfg.model)
    pipe = family.load_pipeline()
    images = [Image.open(root / folder / "item_0.png").convert("RGB") for folder in ("ref1", "ref2")]
    calls = []
    pipe.transformer.register_forward_pre_hook(lambda m, a, kw: calls.append(kw), with_kwargs=True)
    with torch.no_grad():
        pipe(prompt="swap the colours", image=images, width=SIZE[0], height=SIZE[1], num_inference_steps=1,
             guidance_scale=1.0, max_sequence_length=family.max_sequence_length, output_type="latent")
        pixels = [pipe.image_processor.preprocess(img, height=SIZE[1], width=SIZE[0], resize_mode="crop")
                  for img in images]
        control = torch.cat([family.encode_pixels(pipe.vae, px[:, :, None]) for px in pixels], dim=2)
    tokens, ids = reference_tokens(control)
    n = tokens.shape[1] // 2  # the target has as many tokens as each reference
    torch.testing.assert_close(tokens, calls[0]["hidden_states"][:, n:], rtol=1e-5, atol=1e-5)
    assert torch.equal(ids, calls[0]["img_ids"][:, n:]) and set(ids[0, :, 0].tolist()) == {10, 20}


def _outputs(family, denoiser, batch, control):
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(0))
    seen = []
    handle = denoiser.register_forward_hook(lambda m, a, kw, o: seen.append(o[0]), with_kwargs=True)
    try:
        with torch.no_grad():
            loss = family.loss(denoiser, batch["latents"], batch["text"], torch.Generator(),
                               t=torch.tensor([0.3, 0.7]), noise=noise, control=control)
    finally:
        handle.remove()
    return seen[0], loss


def test_each_reference_conditions_the_loss_and_the_lora_loads(run):
    cfg, p, _ = run
    family = get_family(cfg.model)
    batch = CachedDataset.from_run(p).collate([0, 1])
    control = batch["control_latents"]
    assert control.shape[2] == 2
    pipe = family.load_pipeline()
    base, loss = _outputs(family, pipe.transformer, batch, control)
    for k in range(2):
        other = control.clone()
        other[:, :, k] = 0
        assert not torch.equal(loss, _outputs(family, pipe.transformer, batch, other)[1]), k
    family.load_lora(pipe, p.export_diffusers)
    loaded, _ = _outputs(family, pipe.transformer, batch, control)
    expected, _ = _outputs(family, apply_adapter(family.load_denoiser(), p.adapter_dir), batch, control)
    assert (loaded - base).abs().max() > 1e-5, "the LoRA does not change the output"
    torch.testing.assert_close(loaded, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["flux2-klein", "flux2"])
def test_edit_variant_checks(name):
    family = get_family(ModelConfig(family=name, variant="edit"))
    text = {"prompt_embeds": torch.zeros(1, 8, family.denoiser_model.tiny["joint_attention_dim"])}
    with pytest.raises(ValueError, match="control_path"):
        family.loss(None, torch.zeros(1, 16, 1, 4, 4), text, torch.Generator())
    with pytest.raises(ValueError, match="pipeline parallelism is not implemented"):
        family.pipeline_layers(None)
    assert not get_family(ModelConfig(family=name)).uses_control
