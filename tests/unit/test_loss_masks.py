"""Loss-mask pieces on their own: the weighted reduction, mask decoding, the latent grid, packing."""

from __future__ import annotations

import inspect
import io

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline
from PIL import Image

from diffpipe.cache_jobs import latent_mask
from diffpipe.config import ConfigError, ModelConfig, ObjectiveConfig, parse_config
from diffpipe.data.cache.buckets import load_mask_array
from diffpipe.families import family_names, get_family
from diffpipe.models import objectives as obj


def test_weighted_reduction_matches_hand_computation():
    err = torch.arange(16, dtype=torch.float32).reshape(2, 2, 2, 2)
    mask = torch.tensor([[[[1.0, 0.0], [0.5, 0.0]]], [[[1.0, 1.0], [1.0, 1.0]]]])  # [2, 1, 2, 2]
    got = obj.reduce_per_sample(err, mask)
    w = mask.expand_as(err)
    expected = (w * err).flatten(1).sum(1) / w.flatten(1).sum(1)
    torch.testing.assert_close(got, expected)
    assert got[0] == pytest.approx((0 + 0.5 * 2 + 4 + 0.5 * 6) / 3)
    torch.testing.assert_close(got[1], err[1].mean())  # all ones = the plain mean
    zero = obj.reduce_per_sample(err, torch.zeros(2, 1, 2, 2))
    assert torch.equal(zero, torch.zeros(2))  # all masked out: no loss, no NaN
    torch.testing.assert_close(obj.mask_weights(mask, 0.2)[0, 0, 0], torch.tensor([1.0, 0.2]))
    # Per-sample weights (Min-SNR) still scale the masked mean.
    pred, target = torch.randn(2, 2, 2, 2), torch.randn(2, 2, 2, 2)
    weights = torch.tensor([0.5, 2.0])
    plain = obj.per_sample_loss(pred, target, kind="huber", mask=mask)
    torch.testing.assert_close(obj.per_sample_loss(pred, target, weights, kind="huber", mask=mask), plain * weights)


def test_mask_images_decode_from_values_or_alpha():
    def decode(img: Image.Image) -> np.ndarray:
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        buf.seek(0)
        return load_mask_array(buf, (4, 4))[0, 0]

    gray = np.array([[0, 255, 255, 0]] * 4, np.uint8)
    np.testing.assert_allclose(decode(Image.fromarray(gray, "L")), gray / 255)
    deep = Image.fromarray(gray.astype(np.uint16) * 257)  # a 16-bit mask
    assert deep.mode.startswith("I;16")
    np.testing.assert_allclose(decode(deep), gray / 255)
    # A transparent layer: the alpha is the mask, whatever colour is painted.
    rgba = np.zeros((4, 4, 4), np.uint8)
    rgba[..., 3] = gray
    np.testing.assert_allclose(decode(Image.fromarray(rgba, "RGBA")), gray / 255)
    # Fully opaque RGBA (editors save masks like this): the colour values are the mask.
    rgba[..., :3], rgba[..., 3] = gray[..., None], 255
    np.testing.assert_allclose(decode(Image.fromarray(rgba, "RGBA")), gray / 255)
    flipped = load_mask_array(io.BytesIO(_png(Image.fromarray(gray[:, :2].repeat(2, 1), "L"))), (4, 4), flip=True)
    np.testing.assert_allclose(flipped[0, 0], gray[:, :2].repeat(2, 1)[:, ::-1] / 255)


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_latent_mask_is_the_block_mean_on_every_latent_frame():
    mask = np.zeros((1, 1, 8, 8), np.float32)
    mask[..., :3] = 1  # a column edge inside the second 2x2 block
    got = latent_mask(mask, (16, 3, 4, 4))
    assert got.shape == (1, 3, 4, 4)
    np.testing.assert_allclose(got[0, 0, 0].numpy(), [1.0, 0.5, 0.0, 0.0])
    assert torch.equal(got[:, 0], got[:, 2])


def test_every_family_loss_takes_a_mask():
    for name in family_names():
        loss = type(get_family(ModelConfig(family=name))).loss
        assert "mask" in inspect.signature(loss).parameters, name


def test_packed_mask_lines_up_with_packed_tokens():
    family = get_family(ModelConfig(family="flux"))
    b, c, h, w = 2, 4, 4, 6
    x0 = torch.randn(b, c, h, w)
    mask = torch.rand(b, 1, 1, h, w)
    packed = family.loss_mask(mask, x0, ObjectiveConfig(mask_min_weight=0.1),
                              lambda m: FluxPipeline._pack_latents(m, b, c, h, w))
    weights = 0.1 + 0.9 * mask[:, :, 0]
    torch.testing.assert_close(packed * FluxPipeline._pack_latents(x0, b, c, h, w),
                               FluxPipeline._pack_latents(weights * x0, b, c, h, w))


def test_flux_masked_loss_is_the_weighted_mean_of_its_tokens():
    family = get_family(ModelConfig(family="flux"))
    denoiser = family.load_denoiser()
    latents = torch.randn(2, 1, 1, 8, 8, generator=torch.Generator().manual_seed(0))  # tiny VAE: 1 channel
    enc = family.load_text_encoders()
    text = family.encode_text(enc, ["a red circle", "a blue square"])
    mask = torch.zeros(2, 1, 1, 8, 8)
    mask[..., :4] = 1
    t, noise = torch.tensor([0.3, 0.6]), torch.randn(latents.shape, generator=torch.Generator().manual_seed(1))
    out = []
    handle = denoiser.register_forward_hook(lambda m, a, o: out.append(o[0]))
    with torch.no_grad():
        got = family.loss(denoiser, latents, text, torch.Generator(), t=t, noise=noise, mask=mask)
        ones = family.loss(denoiser, latents, text, torch.Generator(), t=t, noise=noise,
                           mask=torch.ones_like(mask))
        plain = family.loss(denoiser, latents, text, torch.Generator(), t=t, noise=noise)
    handle.remove()
    x0 = latents[:, :, 0]
    target = FluxPipeline._pack_latents(noise[:, :, 0] - x0, 2, 1, 8, 8)
    err = (out[0] - target).pow(2)
    # 2x2 packing: each token holds a 2x2 latent patch; the left half's tokens are all kept.
    keep = FluxPipeline._pack_latents(mask[:, :, 0], 2, 1, 8, 8)
    assert set(keep.unique().tolist()) == {0.0, 1.0}
    expected = (keep * err).flatten(1).sum(1) / keep.flatten(1).sum(1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ones, plain, rtol=1e-6, atol=0)
    assert not torch.allclose(got, plain)


def test_aux_config_fields():
    ds = {"name": "d", "path": "x"}
    cfg = parse_config({"datasets": [{**ds, "mask_path": "m", "control_column": "edit"}]})
    assert cfg.datasets[0].aux_roles() == ["mask", "control"]
    with pytest.raises(ConfigError, match="mask_path or mask_column"):
        parse_config({"datasets": [{**ds, "mask_path": "m", "mask_column": "c"}]})
    with pytest.raises(ConfigError, match="mask_min_weight"):
        parse_config({"datasets": [ds], "train": {"objective": {"mask_min_weight": 1.5}}})
