"""Synthetic training batches for ``diffpipe bench``: the real shapes, no cache.

The parent encodes one blank image per (resolution, frames) with the family's
VAE and one caption with its text encoders, once for the whole sweep, and saves
the results; each point's process builds a ``CachedDataset`` from them: random
latents of the encoded shape and the encoded caption on every item. Training
cost depends on shapes, not values, so a point measures what a real cache of
one square bucket at that resolution would cost.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from diffpipe.config import Config, ConfigError
from diffpipe.data.cache.reader import CachedDataset, _Item
from diffpipe.families import get_family
from diffpipe.utils import atomic_path

CAPTION = "a photo of a red circle on a white background"


def input_name(shape: tuple[int, int]) -> str:
    return f"inputs-{shape[0]}px-{shape[1]}f.safetensors"


def encode_inputs(cfg: Config, shapes: list[tuple[int, int]], out_dir: Path) -> dict[tuple[int, int], Path]:
    """One latent per (resolution, frames) and one caption's embeddings, saved under ``out_dir``."""
    family = get_family(cfg.model)
    if family.uses_control:
        raise ConfigError(f"bench.data synthetic: model family {family.name!r} needs a control image per item; "
                          "use bench.data: cache")
    files = {s: out_dir / input_name(s) for s in shapes}  # rewritten each sweep: the model may have changed
    with torch.no_grad():
        text = family.encode_text(family.load_text_encoders(), [CAPTION])
        vae = family.load_vae()
        for (res, frames), file in files.items():
            side = max(family.pixel_multiple, res // family.pixel_multiple * family.pixel_multiple)
            latents = family.encode_pixels(vae, torch.zeros(1, 3, frames, side, side))
            tensors = {"latents": latents[0].float().contiguous(), "size": torch.tensor([side, side])}
            tensors.update({f"text.{k}": v[0].float().contiguous() for k, v in text.items()})
            out_dir.mkdir(parents=True, exist_ok=True)
            with atomic_path(file) as tmp:
                save_file(tensors, str(tmp))
    return files


def synthetic_dataset(file: Path, items: int, seed: int = 0) -> CachedDataset:
    """``items`` items of one bucket: random latents of the saved shape, the saved caption on each."""
    saved = load_file(str(file))
    shape, (h, w) = saved["latents"].shape, saved["size"].tolist()
    bucket = f"synthetic-{h}x{w}x{shape[1]}"
    gen = torch.Generator().manual_seed(seed)
    latents = {bucket: torch.randn(items, *shape, generator=gen)}
    text = {k[len("text."):]: v.expand(items, *v.shape).contiguous() for k, v in saved.items() if k.startswith("text.")}
    rows = [_Item(id=f"synthetic/{i:04d}", path=f"synthetic/{i:04d}", bucket=bucket, row=i, text_row=i, repeats=1,
                  sizes=(h, w, 0, 0)) for i in range(items)]
    empty = {k: v[:1].clone() for k, v in text.items()}
    return CachedDataset(rows, latents, text, empty, shards=[])
