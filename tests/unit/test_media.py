"""Media probing: format sniffing, one RGB conversion, truncation and bombs."""

import io

import numpy as np
from PIL import Image

from diffpipe.data.cache import buckets
from diffpipe.data.dataset import media


def _png(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def test_caching_and_validation_share_one_rgb_conversion():
    assert buckets.to_rgb is media.to_rgb
    gray16 = Image.fromarray(np.full((4, 4), 65535, np.uint16))
    assert (
        np.asarray(media.to_rgb(gray16)).max() == 255
    )  # scaled, not clipped to 255 from 65535 % 256
    rgba = Image.new("RGBA", (2, 2), (0, 0, 0, 0))
    assert media.to_rgb(rgba).getpixel((0, 0)) == (255, 255, 255)  # transparent -> white
    assert media.to_rgb(Image.new("CMYK", (2, 2), (0, 0, 0, 0))).mode == "RGB"


def test_sniff_knows_the_common_formats():
    img = Image.new("RGB", (8, 8))
    for fmt, name in (
        ("PNG", "png"),
        ("JPEG", "jpeg"),
        ("GIF", "gif"),
        ("WEBP", "webp"),
        ("BMP", "bmp"),
        ("TIFF", "tiff"),
    ):
        assert media.sniff(_png(img, fmt)[:32]) == name
    assert media.sniff(b"\x00\x00\x00\x18ftypisom") == "mp4"
    assert media.sniff(b"\x1a\x45\xdf\xa3....") == "matroska"
    assert media.sniff(b"hello world") is None


def test_probe_full_decode_catches_truncated_jpeg(tmp_path):
    rng = np.random.default_rng(0)
    data = _png(Image.fromarray(rng.integers(0, 255, (256, 256, 3), np.uint8)), "JPEG", quality=95)
    (tmp_path / "ok.jpg").write_bytes(data)
    (tmp_path / "cut.jpg").write_bytes(data[: len(data) // 2])
    ok = media.probe(str(tmp_path / "ok.jpg"), "image", 10**8)
    assert not ok.problems and (ok.width, ok.height, ok.frames) == (256, 256, 1)
    cut = media.probe(str(tmp_path / "cut.jpg"), "image", 10**8)
    assert [r for r, _ in cut.problems] == ["corrupt_media"] and cut.sha256


def test_bomb_is_judged_from_the_header(tmp_path):
    (tmp_path / "big.png").write_bytes(_png(Image.new("1", (4000, 3000))))
    p = media.probe(str(tmp_path / "big.png"), "image", 1_000_000)
    assert [r for r, _ in p.problems] == ["decompression_bomb"] and (p.width, p.height) == (
        4000,
        3000,
    )
