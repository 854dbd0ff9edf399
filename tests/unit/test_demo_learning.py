"""The demo's learning statistic (tests/demo_learning.py) on images whose answer is known."""

from __future__ import annotations

import pytest
from demo_learning import MARGIN, learning_gain, mean_area, shape_area
from PIL import Image, ImageDraw

from diffpipe.data.dataset.demo import COLORS, demo_item


def _square(side: int, fg: str = "red", bg: str = "blue", size: int = 64) -> Image.Image:
    img = Image.new("RGB", (size, size), COLORS[bg])
    ImageDraw.Draw(img).rectangle((10, 10, 10 + side - 1, 10 + side - 1), fill=COLORS[fg])
    return img


def test_shape_area_is_the_share_of_the_image_off_the_background():
    assert shape_area(Image.new("RGB", (64, 64), COLORS["white"])) == 0.0
    assert shape_area(_square(32)) == pytest.approx(0.25)
    assert shape_area(_square(16, "yellow", "black")) == pytest.approx(1 / 16)


def test_the_demo_images_hold_large_shapes():
    """The demo's 16 images (what the LoRA learns) average well above the base model's 12-20 px shapes."""
    images = [demo_item(i)[0] for i in range(16)]
    assert mean_area(images) > 0.2 > mean_area([_square(20)]) + MARGIN


def test_learning_gain_is_positive_toward_the_training_images_and_zero_without_change():
    train, small, large = [_square(40)], [_square(14)], [_square(34)]
    assert learning_gain(small, large, train) >= MARGIN
    assert learning_gain(small, small, train) == 0.0  # a zeroed LoRA: samples equal the base's
    assert learning_gain(large, small, train) < 0
