import math

import numpy as np
import pytest
import torch
from PIL import Image

from diffpipe.data.cache.buckets import bucket_sizes, choose_bucket, load_image
from diffpipe.data.dataset.demo import demo_item, write_demo_dataset


@pytest.mark.parametrize("resolution,multiple", [(64, 4), (64, 8), (512, 8), (1024, 16)])
def test_bucket_sizes_are_multiples_with_area_near_resolution(resolution, multiple):
    sizes = bucket_sizes(resolution, multiple)
    assert (resolution, resolution) in sizes
    for h, w in sizes:
        assert h % multiple == 0 and w % multiple == 0
        assert abs(h * w / resolution**2 - 1) < 0.15, (h, w)
        assert 0.45 <= w / h <= 2.2
    ratios = [w / h for h, w in sizes]
    assert ratios == sorted(ratios) and len(set(sizes)) == len(sizes)


def test_choose_bucket_picks_nearest_aspect():
    assert choose_bucket(300, 300, 512, 8) == (512, 512)
    sizes = bucket_sizes(512, 8)
    assert choose_bucket(2000, 1000, 512, 8) == sizes[-1]  # 2:1 -> widest
    assert choose_bucket(100, 1000, 512, 8) == sizes[0]  # beyond 1:2 -> tallest
    h, w = choose_bucket(1920, 1080, 512, 8)
    assert math.isclose(w / h, 16 / 9, rel_tol=0.05)
    with pytest.raises(ValueError, match="positive"):
        choose_bucket(0, 10, 512, 8)


def test_load_image_shape_range_and_cover_crop(tmp_path):
    # Left half red, right half blue, 2:1; a square bucket keeps the center.
    arr = np.zeros((32, 64, 3), np.uint8)
    arr[:, :32] = (255, 0, 0)
    arr[:, 32:] = (0, 0, 255)
    Image.fromarray(arr).save(tmp_path / "a.png")
    t = load_image(tmp_path / "a.png", (16, 16))
    assert t.shape == (3, 1, 16, 16) and t.dtype == torch.float32
    assert t.min() >= -1 and t.max() <= 1
    assert t[0, 0, :, 0].mean() > 0.9 and t[2, 0, :, -1].mean() > 0.9  # both halves survive

    # Top/middle/bottom stripes, 1:1 into a 2:1 bucket: top and bottom are cut.
    arr = np.zeros((60, 60, 3), np.uint8)
    arr[:15] = (255, 0, 0)
    arr[15:45] = (0, 255, 0)
    arr[45:] = (0, 0, 255)
    Image.fromarray(arr).save(tmp_path / "b.png")
    t = load_image(tmp_path / "b.png", (8, 16))
    assert t.shape == (3, 1, 8, 16)
    # Inner rows are pure green; edge rows see a little of the cut bands (filter support).
    assert torch.allclose(t[1, :, 1:-1], torch.ones(1, 6, 16), atol=0.02)
    assert t[0].mean() < -0.9 and t[2].mean() < -0.9


def test_load_image_applies_exif_orientation(tmp_path):
    arr = np.zeros((20, 40, 3), np.uint8)
    arr[:, :20] = 255  # white left half, landscape as stored
    img = Image.fromarray(arr)
    exif = Image.Exif()
    exif[0x0112] = 6  # displayed rotated 90° clockwise: portrait, white on top
    img.save(tmp_path / "r.png", exif=exif.tobytes())
    t = load_image(tmp_path / "r.png", (40, 20))
    assert t.shape == (3, 1, 40, 20)
    assert t[:, 0, :18].mean() > 0.9 and t[:, 0, 22:].mean() < -0.9


def _modes(tmp_path):
    rgba = Image.new("RGBA", (20, 20), (255, 0, 0, 0))  # fully transparent red
    yield "RGBA", rgba, 1.0
    pal = Image.new("P", (20, 20), 0)
    pal.putpalette([0, 0, 0] * 256)
    pal.info["transparency"] = 0
    yield "P+transparency", pal, 1.0
    yield "LA", Image.new("LA", (20, 20), (0, 0)), 1.0
    yield "CMYK", Image.new("CMYK", (20, 20), (0, 0, 0, 0)), 1.0
    yield "I;16", Image.fromarray(np.full((20, 20), 65535, np.uint16)), 1.0
    yield "I;16 mid", Image.fromarray(np.full((20, 20), 32896, np.uint16)), 0.0
    yield "1", Image.new("1", (20, 20), 0), -1.0
    yield "L", Image.new("L", (20, 20), 255), 1.0


def test_every_mode_becomes_rgb_the_same_way(tmp_path):
    for name, img, expected in _modes(tmp_path):
        path = tmp_path / f"{name.replace(' ', '_').replace(';', '_')}.png"
        if img.mode == "CMYK":
            path = path.with_suffix(".jpg")
        img.save(path)
        t = load_image(path, (16, 16))
        assert t.shape == (3, 1, 16, 16), name
        assert abs(t.mean().item() - expected) < 0.02, (name, t.mean().item())


def test_demo_dataset_is_deterministic(tmp_path):
    a = write_demo_dataset(tmp_path / "a", n=4, size=32)
    b = write_demo_dataset(tmp_path / "b", n=4, size=32)
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]
    caption = (tmp_path / "a" / a[0].with_suffix(".txt").name).read_text().strip()
    img, expected = demo_item(0, size=32)
    assert caption == expected and caption.startswith("a ") and "background" in caption
    assert img.size == (32, 32)


def test_log_spaced_ratios_and_explicit_buckets():
    from diffpipe.data.cache.buckets import log_spaced_ratios

    r = log_spaced_ratios(0.5, 2.0, 5)
    assert r[0] == pytest.approx(0.5) and r[-1] == pytest.approx(2.0) and r[2] == pytest.approx(1.0)
    assert all(r[i + 1] / r[i] == pytest.approx(r[1] / r[0]) for i in range(4))
    sizes = bucket_sizes(512, 16, r)
    assert len(sizes) == 5 and all(h % 16 == 0 and w % 16 == 0 for h, w in sizes)
    assert all(abs(h * w / 512**2 - 1) < 0.1 for h, w in sizes)
    assert choose_bucket(1000, 1000, 512, 16, (1.0, 3.0)) == (512, 512)
    assert choose_bucket(3000, 1000, 512, 16, (1.0, 3.0)) == bucket_sizes(512, 16, (1.0, 3.0))[-1]
    with pytest.raises(ValueError):
        log_spaced_ratios(2.0, 1.0, 3)


def test_crop_offset_and_flip(tmp_path):
    from diffpipe.data.cache.buckets import crop_offset

    fy, fx = crop_offset("abc")
    assert crop_offset("abc") == (fy, fx) != crop_offset("abd") and 0 <= fy <= 1 and 0 <= fx <= 1
    arr = np.zeros((32, 64, 3), np.uint8)
    arr[:, :32] = 255  # white left half
    Image.fromarray(arr).save(tmp_path / "a.png")
    left = load_image(tmp_path / "a.png", (16, 16), crop=(0.5, 0.0))
    right = load_image(tmp_path / "a.png", (16, 16), crop=(0.5, 1.0))
    assert left.mean() > 0.9 and right.mean() < -0.9
    flipped = load_image(tmp_path / "a.png", (16, 32), flip=True)
    assert torch.equal(flipped, load_image(tmp_path / "a.png", (16, 32)).flip(-1))
