"""Sample images from the stock diffusers pipeline with an exported LoRA loaded."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image, ImageDraw

from diffpipe.config import ModelConfig, SampleConfig
from diffpipe.models import get_family
from diffpipe.utils import atomic_path


def _render(pipe, prompts: list[str], kwargs: dict, seed: int) -> list[Image.Image]:
    images = []
    for prompt in prompts:
        gen = torch.Generator().manual_seed(seed)
        images.append(pipe(prompt, generator=gen, **kwargs).images[0])
    return images


def render_samples(model_cfg: ModelConfig, cfg: SampleConfig, lora_file: str | Path, out_dir: str | Path) -> list[Path]:
    """Render every prompt with and without the LoRA (same seed) and save PNGs plus a grid.

    The grid's top row is the base model, the bottom row the LoRA: a quick look
    at what training changed.
    """
    family = get_family(model_cfg)
    pipe = family.load_pipeline()
    pipe.set_progress_bar_config(disable=True)
    kwargs = family.sample_kwargs(cfg)
    base = _render(pipe, cfg.prompts, kwargs, cfg.seed)
    pipe.load_lora_weights(str(lora_file))
    tuned = _render(pipe, cfg.prompts, kwargs, cfg.seed)
    out_dir = Path(out_dir)
    with atomic_path(out_dir, is_dir=True) as tmp:
        for i, img in enumerate(tuned):
            img.save(tmp / f"sample-{i:02d}.png")
        _grid(base, tuned, cfg.prompts).save(tmp / "grid.png")
    return sorted(out_dir.glob("*.png"))


def _grid(base: list[Image.Image], tuned: list[Image.Image], prompts: list[str]) -> Image.Image:
    w, h = base[0].size
    label = 14
    grid = Image.new("RGB", (w * len(base), 2 * (h + label)), "white")
    draw = ImageDraw.Draw(grid)
    for col, (b, t, p) in enumerate(zip(base, tuned, prompts, strict=True)):
        draw.text((col * w + 2, 0), "base: " + p[: w // 6], fill="black")
        grid.paste(b, (col * w, label))
        draw.text((col * w + 2, h + label), "LoRA", fill="black")
        grid.paste(t, (col * w, h + 2 * label))
    return grid
