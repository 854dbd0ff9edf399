"""Kandinsky 5.0 Image Lite editing (``kandinsky5-image``, ``model.variant: i2i``) on its tiny flavor.

Four items, each with the image to edit in a control folder: validate → plan → cache (the targets, the
control latents, each caption encoded with its control image) → 2 DeepSpeed steps → diffusers export →
a sample editing ``sample.images``, in-process through the Typer app. Then, against the stock
``Kandinsky5I2IPipeline``: the cached text equals its ``encode_prompt`` on the caption and the control
image; the transformer's visual-condition channels are what its ``prepare_latents`` builds (its image
latents drawn at the distribution's mean, as the cache stores them); the control conditions the loss;
the exported LoRA loads into the pipeline and reproduces the trained adapter. Losses and LoRA are golden.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml
from diffusers import Kandinsky5I2IPipeline
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from PIL import Image
from stage_cli import rendezvous, run_stages

from diffpipe.config import ModelConfig, ObjectiveConfig, load_config
from diffpipe.data.cache.plan import read_spec
from diffpipe.data.cache.reader import CachedDataset
from diffpipe.data.cache.text import TextShard
from diffpipe.families import get_family
from diffpipe.families.kandinsky5_image.family import VISION_SLOT
from diffpipe.paths import RunPaths
from diffpipe.training.adapter import apply_adapter

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("k5edit")
    rng = np.random.default_rng(0)
    for folder in ("data", "source"):
        (root / folder).mkdir()
    for i in range(4):  # the source image: the target with its colours inverted
        img = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
        Image.fromarray(img).save(root / "data" / f"item_{i}.png")
        (root / "data" / f"item_{i}.txt").write_text("invert the colours" if i % 2 else "make it a photo negative")
        Image.fromarray(255 - img).save(root / "source" / f"item_{i}.png")
    Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(root / "edit_me.png")
    cfg = {
        "output_dir": "run",
        "model": {"family": "kandinsky5-image", "flavor": "tiny", "variant": "i2i"},
        "datasets": [{"name": "edits", "path": str(root / "data"), "control_path": str(root / "source"),
                      "resolution": 32}],
        "cache": {"shards": 1, "workers": 0},
        "train": {"max_steps": 2, "batch_size": 2, "lr": 0.01, "save_every_epochs": 0, "eval": {"quantiles": []}},
        "export": {"formats": ["diffusers"]},
        "sample": {"prompts": ["invert the colours"], "images": [str(root / "edit_me.png")], "steps": 2},
    }
    config = root / "k5edit.yaml"
    config.write_text(yaml.safe_dump(cfg))
    monkeypatch = rendezvous()
    try:
        run_stages(str(config), cwd=root, monkeypatch=monkeypatch, empty_caption=True)
    finally:
        monkeypatch.undo()
    return load_config(config), RunPaths(root / "run")


def test_stages_and_golden(run, golden):
    cfg, p = run
    assert p.sample_grid.exists() and len(p.metrics.read_text().splitlines()) == 2
    golden("kandinsky5-image", "test_kandinsky5_edit::run", p)


def test_cached_text_is_the_pipelines_prompt_with_the_image(run):
    cfg, p = run
    family = get_family(cfg.model)
    pipe = family.load_pipeline()
    assert isinstance(pipe, Kandinsky5I2IPipeline)
    spec = read_spec(p.text_spec(p.shard_names("text")[0]))
    shard = TextShard(p.text_shard(p.shard_names("text")[0]))
    embeds, masks, pooled = shard.read("prompt_embeds"), shard.read("prompt_embeds_mask"), shard.read("pooled_prompt_embeds")
    by_id = {item_id: r for r, item_id in enumerate(shard.ids)}
    for item in spec["items"][:2]:
        image = Image.open(item["control"]["path"]).convert("RGB")
        with torch.no_grad():
            qwen, clip, _ = pipe.encode_prompt(item["caption"], image=image, max_sequence_length=family.max_sequence_length,
                                               device=torch.device("cpu"), dtype=torch.float32)
        r, n = by_id[item["id"]], qwen.shape[1]
        assert masks[r].sum() == n and not np.any(embeds[r][n:])
        torch.testing.assert_close(torch.from_numpy(embeds[r][:n].copy()), qwen[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.from_numpy(pooled[r].copy()), clip[0], rtol=1e-5, atol=1e-5)
        image_tokens = (pipe.tokenizer(text=[pipe.prompt_template.format(item["caption"])], images=[
            image.resize((16, 16))], return_tensors="pt")["input_ids"] == pipe.tokenizer.image_token_id).sum()
        assert image_tokens > 0  # the image reached the text encoder


def test_condition_channels_are_the_pipelines_and_the_lora_loads(run, monkeypatch):
    cfg, p = run
    family = get_family(cfg.model)
    pipe = family.load_pipeline()
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    monkeypatch.setattr(DiagonalGaussianDistribution, "sample", lambda self, generator=None: self.mode())
    with torch.no_grad():
        built = pipe.prepare_latents(image=image, batch_size=1, num_channels_latents=4, height=32, width=32,
                                     dtype=torch.float32, device=torch.device("cpu"),
                                     generator=torch.Generator().manual_seed(0))
        pixels = pipe.image_processor.preprocess(image, height=32, width=32)[:, :, None]
        control = family.encode_pixels(pipe.vae, pixels)
    text = family.encode_text(family.load_text_encoders(), ["invert the colours"], images=[image])
    prepared = family.prepare(control, text, torch.Generator().manual_seed(0), objective=ObjectiveConfig(),
                              control=control)
    ours = prepared.inputs["hidden_states"]
    assert ours.shape == built.shape == (1, 1, 4, 4, 9)
    torch.testing.assert_close(ours[..., 4:], built[..., 4:], rtol=1e-5, atol=1e-5)

    batch = CachedDataset.from_run(p).collate([0, 1])
    control = batch["control_latents"]
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(0))

    def loss(denoiser, control):
        with torch.no_grad():
            return family.loss(denoiser, batch["latents"], batch["text"], torch.Generator(), t=torch.tensor([0.3, 0.7]),
                               noise=noise, control=control)

    base = loss(pipe.transformer, control)
    assert not torch.allclose(base, loss(pipe.transformer, torch.zeros_like(control)))  # the image conditions it
    pipe.load_lora_weights(str(p.export_diffusers))
    loaded = loss(pipe.transformer, control)
    expected = loss(apply_adapter(family.load_denoiser(), p.adapter_dir), control)
    assert (loaded - base).abs().max() > 1e-6, "the LoRA does not change the loss"
    torch.testing.assert_close(loaded, expected, rtol=1e-5, atol=1e-5)


def test_edit_settings_are_checked(tmp_path):
    family = get_family(ModelConfig(family="kandinsky5-image", variant="i2i"))
    with pytest.raises(ValueError, match="needs a control image per item"):
        family.loss(None, torch.zeros(1, 4, 1, 8, 8), {}, torch.Generator())
    with pytest.raises(ValueError, match="pipeline parallelism is not implemented"):
        family.pipeline_layers(family.load_denoiser())
    assert family.max_sequence_length == 64 and VISION_SLOT in family.template
    empty = family.encode_text(family.load_text_encoders(), [""], images=[None])  # the empty-caption cache
    assert empty["prompt_embeds_mask"].sum() > 0 and empty["pooled_prompt_embeds"].shape == (1, 32)
    Kandinsky5I2IPipeline(**get_family(ModelConfig(family="kandinsky5-image", variant="i2i")).load_pipeline()
                          .components).save_pretrained(tmp_path)
    local = get_family(ModelConfig(family="kandinsky5-image", flavor="local", path=str(tmp_path)))
    assert local.variant == "i2i" and local.text_identity() == family.text_identity()
