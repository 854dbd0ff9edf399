"""Measure a demo model folder (``scripts/train_demo_model.py``'s output): does it draw what the prompt says?

Prints one JSON line per part and writes a grid of the samples (a row per prompt, a column per seed):

- VAE: mean absolute reconstruction error (0..255) on 64 base images, and the share of pixels (and of
  the 3-pixel border, i.e. background) whose nearest demo colour survives encode + decode;
- UNet + text encoder: for six prompts x four seeds, the share of border pixels whose nearest demo colour is
  the prompt's background (``bg_border_match``; chance is about 1/6), the share of non-background pixels
  nearest the prompt's shape colour (``shape_fg_match``), and the learning check's statistic, the share
  of all pixels nearest the prompt's shape colour (``shape_colour_share``; the demo images': 0.293).

    python scripts/check_demo_model.py config/demo_model --grid /tmp/grid.png [--steps 10] [--guidance 4]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKL, StableDiffusionPipeline
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests")]  # train_demo_model, demo_learning: plain modules
from demo_learning import colour_share  # noqa: E402
from train_demo_model import base_dataset  # noqa: E402

from diffpipe.data.dataset.demo import COLORS  # noqa: E402

PALETTE = np.array(list(COLORS.values()), dtype=np.float32)
NAMES = list(COLORS)
PROMPTS = [("red", "circle", "blue"), ("yellow", "square", "black"), ("green", "triangle", "white"),
           ("white", "circle", "red"), ("blue", "square", "yellow"), ("black", "triangle", "green")]


def nearest(rgb: np.ndarray) -> np.ndarray:
    """Index (into COLORS) of each pixel's nearest demo colour; ``rgb``: ``[..., 3]`` in 0..255."""
    return np.argmin(((rgb[..., None, :] - PALETTE) ** 2).sum(-1), axis=-1)


def border(a: np.ndarray, w: int = 3) -> np.ndarray:
    return np.concatenate([a[:w].ravel(), a[-w:].ravel(), a[:, :w].ravel(), a[:, -w:].ravel()])


@torch.no_grad()
def vae_check(folder: Path) -> dict[str, float]:
    vae = AutoencoderKL.from_pretrained(folder, subfolder="vae").eval()
    pixels, _ = base_dataset(64, 123)
    rec = vae.decode(vae.encode(pixels).latent_dist.mode()).sample.clamp(-1, 1)
    orig, back = ((t.permute(0, 2, 3, 1).numpy() + 1) * 127.5 for t in (pixels, rec))
    no, nb = nearest(orig), nearest(back)
    return {"vae_mae_0_255": round(float(np.abs(orig - back).mean()), 2),
            "vae_palette_match": round(float((no == nb).mean()), 4),
            "vae_border_palette_match": round(float((no[:, :3] == nb[:, :3]).mean()), 4)}


def sample_check(folder: Path, steps: int, guidance: float, grid: Path) -> dict[str, float]:
    pipe = StableDiffusionPipeline.from_pretrained(folder, safety_checker=None)
    pipe.set_progress_bar_config(disable=True)
    rows, found = [], []
    for fg, shape, bg in PROMPTS:
        images = pipe([f"a {fg} {shape} on a {bg} background"] * 4, num_inference_steps=steps, guidance_scale=guidance,
                      generator=[torch.Generator().manual_seed(s) for s in range(4)], height=64, width=64).images
        for im in images:
            n = nearest(np.asarray(im.convert("RGB"), dtype=np.float32))
            shape_px = n != NAMES.index(bg)
            found.append(((border(n) == NAMES.index(bg)).mean(),
                          (n[shape_px] == NAMES.index(fg)).mean() if shape_px.any() else 0.0, colour_share(im, fg)))
        rows.append(np.concatenate([np.asarray(i) for i in images], axis=1))
    Image.fromarray(np.concatenate(rows)).resize((512, 768), Image.NEAREST).save(grid)
    m = np.array(found).mean(axis=0)
    return {"bg_border_match": round(float(m[0]), 3), "shape_fg_match": round(float(m[1]), 3),
            "shape_colour_share": round(float(m[2]), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--grid", type=Path, required=True, help="where to write the samples' grid (PNG)")
    ap.add_argument("--steps", type=int, default=10, help="sampling steps (the demo's: 10)")
    ap.add_argument("--guidance", type=float, default=4.0, help="guidance scale (the demo's: 4)")
    args = ap.parse_args()
    print(json.dumps(vae_check(args.folder)))
    print(json.dumps(sample_check(args.folder, args.steps, args.guidance, args.grid)))


if __name__ == "__main__":
    main()
