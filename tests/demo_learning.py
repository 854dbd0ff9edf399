"""The demo's learning check: do the LoRA's samples draw shapes the size of the training images'?

The demo model (``config/demo_model``, made by ``scripts/train_demo_model.py``) draws small shapes;
the 16 demo images (``config/demo_data``) hold large ones. The statistic is the share of an image
that is shape: pixels whose colour is far from the background's (the median of the border pixels).
A plain module (not a conftest), imported by name like ``tiny_runs``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from PIL import Image

#: RGB distance (of 441) from the background colour above which a pixel counts as shape: the demo's
#: colours are at least 90 apart, a blurred edge is not.
SHAPE_DISTANCE = 60.0
#: The least improvement the check asks for: the LoRA's mean shape area must be this much of the
#: image closer to the training images' than the base model's is.
MARGIN = 0.05


def shape_area(image: Image.Image) -> float:
    """The share of ``image`` (0..1) whose colour is more than :data:`SHAPE_DISTANCE` from the background."""
    a = np.asarray(image.convert("RGB"), dtype=np.float32)
    border = np.concatenate([a[:2].reshape(-1, 3), a[-2:].reshape(-1, 3), a[:, :2].reshape(-1, 3),
                             a[:, -2:].reshape(-1, 3)])
    background = np.median(border, axis=0)
    return float((np.linalg.norm(a - background, axis=-1) > SHAPE_DISTANCE).mean())


def mean_area(images: Iterable[Image.Image]) -> float:
    """The mean :func:`shape_area` of ``images``."""
    areas = [shape_area(im) for im in images]
    return float(np.mean(areas))


def learning_gain(base: list[Image.Image], lora: list[Image.Image], train: list[Image.Image]) -> float:
    """How much closer (in shape area, share of the image) the LoRA samples are to the training
    images than the base samples are: positive when the LoRA moved toward what it was trained on."""
    target = mean_area(train)
    return abs(mean_area(base) - target) - abs(mean_area(lora) - target)
