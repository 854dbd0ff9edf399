"""The demo's learning statistic (tests/demo_learning.py) on images whose answer is known."""

from __future__ import annotations

import pytest
from demo_learning import MARGIN, colour_share, learning_gain, mean_share, shape_colour
from PIL import Image, ImageDraw

from diffpipe.data.dataset.demo import COLORS, demo_item

RED_ON_BLUE = "a red square on a blue background"


def _square(side: int, fg: str = "red", bg: str = "blue", size: int = 64) -> Image.Image:
    img = Image.new("RGB", (size, size), COLORS[bg])
    ImageDraw.Draw(img).rectangle((10, 10, 10 + side - 1, 10 + side - 1), fill=COLORS[fg])
    return img


def test_colour_share_counts_only_the_named_colour():
    assert colour_share(_square(32), "red") == pytest.approx(0.25)
    assert colour_share(_square(32), "blue") == pytest.approx(0.75)
    assert colour_share(_square(16, "yellow", "black"), "yellow") == pytest.approx(1 / 16)
    # A shape of another colour than the prompt's is not counted, however large.
    assert colour_share(_square(40, "green"), "red") == 0.0


def test_shape_colour_reads_the_caption_and_rejects_other_text():
    assert shape_colour(RED_ON_BLUE) == "red"
    assert shape_colour("a black triangle on a green background") == "black"
    with pytest.raises(ValueError, match="not a demo caption"):
        shape_colour("a photo of a dog")


def test_the_demo_images_hold_large_shapes():
    """The demo's 16 images (what the LoRA learns) average well above the base model's 12-20 px shapes."""
    items = [demo_item(i) for i in range(16)]
    share = mean_share([im for im, _ in items], [c for _, c in items])
    assert share > 0.2 > colour_share(_square(20), "red") + MARGIN


def test_learning_gain_is_positive_toward_the_training_images_and_zero_without_change():
    train, small, large = [_square(40)], [_square(14)], [_square(34)]
    args = [RED_ON_BLUE], train, [RED_ON_BLUE]
    assert learning_gain(small, large, args[0], *args[1:]) >= MARGIN
    assert learning_gain(small, small, args[0], *args[1:]) == 0.0  # a zeroed LoRA: samples equal the base's
    assert learning_gain(large, small, args[0], *args[1:]) < 0
    # A large shape in the wrong colour is no gain: the statistic reads the prompt.
    assert learning_gain(small, [_square(34, "green")], args[0], *args[1:]) < 0


def test_mean_share_needs_one_caption_per_image():
    with pytest.raises(ValueError, match="2 images for 1 captions"):
        mean_share([_square(10), _square(10)], [RED_ON_BLUE])
