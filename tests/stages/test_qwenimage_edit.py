"""``qwenimage-edit`` on its tiny flavor: edit pairs (target + control image) through every real stage.

validate → plan → cache (targets, control latents, and text encoded with the
control image) → 2 DeepSpeed steps → diffusers export, in-process through the
Typer app. Then: the cached text equals ``QwenImageEditPipeline.encode_prompt``
on the same caption and image, the reference tokens and ``img_shapes`` equal
what the pipeline builds, and the exported LoRA loads into the stock pipeline
and reproduces the trained adapter.

The run's losses and exported LoRA are also compared with the golden values in
``tests/assets/golden_losses.json``; ``DIFFPIPE_UPDATE_GOLDEN=1`` rewrites them
deliberately (see ``tests/golden.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml
from diffusers import QwenImageEditPipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
from PIL import Image
from stage_cli import edit_outputs as _outputs
from stage_cli import rendezvous, run_stages

from diffpipe.config import load_config
from diffpipe.data.cache.plan import read_spec
from diffpipe.data.cache.reader import CachedDataset
from diffpipe.data.cache.text import TextShard
from diffpipe.families import get_family
from diffpipe.families.qwenimage_edit.family import reference_tokens
from diffpipe.paths import RunPaths
from diffpipe.training.adapter import apply_adapter

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwenedit")
    rng = np.random.default_rng(0)
    (root / "data").mkdir()
    (root / "controls").mkdir()
    for i in range(4):  # random targets; the control ("before") image: the target's colours inverted
        img = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
        Image.fromarray(img).save(root / "data" / f"item_{i}.png")
        (root / "data" / f"item_{i}.txt").write_text("make it red" if i % 2 else "turn it blue")
        Image.fromarray(255 - img).save(root / "controls" / f"item_{i}.png")
    cfg = {
        "output_dir": "run",
        "model": {"family": "qwenimage-edit", "flavor": "tiny"},
        "datasets": [
            {"name": "edits", "path": str(root / "data"), "control_path": str(root / "controls"), "resolution": 32}
        ],
        "cache": {"shards": 1, "workers": 0},
        "train": {"max_steps": 2, "batch_size": 2, "lr": 0.01, "save_every_epochs": 0, "eval": {"quantiles": []}},
        "export": {"formats": ["diffusers"]},
    }
    config = root / "qwenedit.yaml"
    config.write_text(yaml.safe_dump(cfg))
    c = str(config)
    monkeypatch = rendezvous()
    try:
        paths = RunPaths(root / "run")
        # No sample stage: the edit pipeline encodes its reference image at about 1024x1024 whatever the
        # output size (77 s on this CPU); `diffpipe sample` with `sample.images` was run by hand.
        run_stages(c, cwd=root, monkeypatch=monkeypatch, then=("train", "export"))
    finally:
        monkeypatch.undo()
    return load_config(config), paths


def test_golden_losses_and_lora(run, golden):
    """The 2 losses and the exported LoRA equal the stored golden values (tests/golden.py)."""
    _, p = run
    golden("qwenimage-edit", "test_qwenimage_edit::run", p)


def test_cached_text_is_the_pipelines_prompt_with_the_image(run):
    cfg, p = run
    family = get_family(cfg.model)
    pipe = family.load_pipeline()
    spec = read_spec(p.text_spec(p.shard_names("text")[0]))
    shard = TextShard(p.text_shard(p.shard_names("text")[0]))
    embeds, masks = shard.read("prompt_embeds"), shard.read("prompt_embeds_mask")
    by_id = {item_id: r for r, item_id in enumerate(shard.ids)}
    items = spec["items"]
    # Two items share a caption but not a control image: different keys, different embeddings.
    assert len({it["caption"] for it in items}) == 2 and len({it["key"] for it in items}) == 4
    for item in items[:2]:
        image = Image.open(item["control"]["path"]).convert("RGB")
        width, height, _ = calculate_dimensions(1024 * 1024, image.size[0] / image.size[1])
        with torch.no_grad():  # what QwenImageEditPipeline.__call__ does with its image and prompt
            expected, _ = pipe.encode_prompt(
                item["caption"], image=pipe.image_processor.resize(image, height, width), device=torch.device("cpu")
            )
        r, n = by_id[item["id"]], expected.shape[1]
        assert masks[r].sum() == n and masks[r][:n].all()
        torch.testing.assert_close(torch.from_numpy(embeds[r][:n].copy()), expected[0], rtol=1e-5, atol=1e-5)
        assert not np.any(embeds[r][n:])


def test_reference_tokens_are_the_pipelines(run):
    cfg, p = run
    family = get_family(cfg.model)
    batch = CachedDataset.from_run(p).collate([0, 1])
    control = batch["control_latents"]  # [B, C, 1, h, w]: the pipeline's 5-D image latents
    tokens, shape = reference_tokens(control[:, :, 0])
    pipe = family.load_pipeline()
    _, image_latents = pipe.prepare_latents(
        control,
        2,
        pipe.transformer.config.in_channels // 4,
        32,
        32,
        torch.float32,
        torch.device("cpu"),
        torch.Generator().manual_seed(0),
    )
    torch.testing.assert_close(tokens, image_latents)
    # The pipeline's img_shapes entry of a 32x32 input image (VAE factor 4, 2x2 packing).
    assert shape == (1, 32 // pipe.vae_scale_factor // 2, 32 // pipe.vae_scale_factor // 2)


def test_loss_sees_the_control_and_the_lora_loads_in_the_stock_pipeline(run):
    cfg, p = run
    family = get_family(cfg.model)
    batch = CachedDataset.from_run(p).collate([0, 1])
    h, w = batch["latents"].shape[-2:]
    pipe = family.load_pipeline()
    assert isinstance(pipe, QwenImageEditPipeline)
    (length, img_shapes, base), loss = _outputs(family, pipe.transformer, batch)
    assert length == 2 * (h // 2) * (w // 2)  # the target's tokens, then the reference's
    assert img_shapes == [[(1, h // 2, w // 2), (1, h // 2, w // 2)]] * 2
    _, other = _outputs(family, pipe.transformer, batch, control=torch.zeros_like(batch["control_latents"]))
    assert not torch.allclose(loss, other)  # the control image conditions the prediction
    pipe.load_lora_weights(str(p.export_diffusers))
    (_, _, loaded), _ = _outputs(family, pipe.transformer, batch)
    (_, _, expected), _ = _outputs(family, apply_adapter(family.load_denoiser(), p.adapter_dir), batch)
    assert (loaded - base).abs().max() > 1e-5, "the LoRA does not change the output"
    torch.testing.assert_close(loaded, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="control"):
        family.loss(pipe.transformer, batch["latents"], batch["text"], torch.Generator())

