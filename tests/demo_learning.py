"""The demo's learning check: do the LoRA's samples draw shapes the size of the training images'?

The demo model (``config/demo_model``, made by ``scripts/train_demo_model.py``) draws small shapes;
the 16 demo images (``config/demo_data``) hold large ones. The statistic is the share of an image drawn
in the prompt's shape colour: pixels whose nearest demo colour (``diffpipe.data.dataset.demo.COLORS``)
is the one the prompt names for the shape. It reads the prompt, so it measures only what the prompt
asks for: an earlier statistic, the share of pixels far from the background colour, also counted the
base model's blotchy backgrounds as shape, which hid the LoRA's gain under their noise.
A plain module (not a conftest), imported by name like ``tiny_runs``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from PIL import Image

from diffpipe.data.dataset.demo import COLORS

#: The least improvement the check asks for: the LoRA's mean shape-colour share must be this much of
#: the image closer to the training images' than the base model's is (a zeroed LoRA scores 0).
MARGIN = 0.05

_PALETTE = np.array(list(COLORS.values()), dtype=np.float32)
_NAMES = list(COLORS)


def shape_colour(caption: str) -> str:
    """The shape colour a demo caption names: "a red circle on a blue background" -> "red"."""
    words = caption.split()
    if len(words) < 3 or words[1] not in COLORS:
        raise ValueError(f"not a demo caption (a <colour> <shape> on a <colour> background): {caption!r}")
    return words[1]


def colour_share(image: Image.Image, colour: str) -> float:
    """The share of ``image`` (0..1) whose nearest demo colour is ``colour``."""
    a = np.asarray(image.convert("RGB"), dtype=np.float32)
    nearest = np.argmin(((a[..., None, :] - _PALETTE) ** 2).sum(-1), axis=-1)
    return float((nearest == _NAMES.index(colour)).mean())


def mean_share(images: Sequence[Image.Image], captions: Sequence[str]) -> float:
    """The mean :func:`colour_share` of ``images``, each in the shape colour of its caption."""
    if len(images) != len(captions) or not images:
        raise ValueError(f"{len(images)} images for {len(captions)} captions")
    return float(np.mean([colour_share(im, shape_colour(c)) for im, c in zip(images, captions, strict=True)]))


def learning_gain(base: Sequence[Image.Image], lora: Sequence[Image.Image], prompts: Sequence[str],
                  train: Sequence[Image.Image], train_captions: Sequence[str]) -> float:
    """How much closer (in shape-colour share, of the image) the LoRA samples are to the training
    images than the base samples are (``base[i]`` and ``lora[i]`` drawn from ``prompts[i]``): positive
    when the LoRA moved toward what it was trained on."""
    target = mean_share(train, train_captions)
    return abs(mean_share(base, prompts) - target) - abs(mean_share(lora, prompts) - target)
