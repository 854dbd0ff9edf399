"""Scaled fp8 base weights (``train.base_weights: fp8``): the layout, its error against a plain float8 cast,
the matmul against PyTorch's own Linear on the dequantised weight, and what autograd keeps."""

from __future__ import annotations

import torch

from diffpipe.training import precision


def _trained_like(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Weights as a trained transformer's Linear has them: small (std ~0.02 / sqrt(width) scaled rows),
    heavy-tailed, rows of different magnitude."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, cols, generator=g) * torch.rand(rows, cols, generator=g).add(0.1).pow(3)
    row_scale = torch.exp(torch.randn(rows, 1, generator=g) * 0.7) * 0.01
    return (base * row_scale).to(torch.bfloat16)


def test_codes_and_scales_reconstruct_within_e4m3s_rounding():
    w = _trained_like(96, 200)
    w[5] = 0  # an all-zero row keeps scale 1 and codes 0
    codes, scale = precision.scaled_fp8(w)
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.bfloat16 and scale.shape == (96, 1)
    assert scale[5].item() == 1 and codes[5].float().abs().sum() == 0
    top = (w.float() / scale.float()).abs().amax()
    assert top <= precision.FP8_MAX  # the bf16 scale was rounded up: no code saturates
    assert top >= precision.FP8_MAX * 0.98  # ... and the row's range is still used
    back = precision.dequantise_fp8(codes.view(torch.uint8), scale.view(torch.uint16), torch.float32)
    err = (back - w.float()).abs()
    # e4m3: 3 mantissa bits (half-ulp 2^-4 relative), subnormal spacing 2^-9 of the scale.
    assert (err <= w.float().abs() * 2**-4 + scale.float() * 2**-10 + 1e-12).all()


def test_scaled_fp8_keeps_small_weights_a_plain_cast_loses():
    w = _trained_like(256, 256).float() * 0.05  # many weights under 2^-6: plain e4m3's subnormal range
    plain = w.to(torch.float8_e4m3fn).float()
    codes, scale = precision.scaled_fp8(w)
    scaled = codes.float() * scale.float()
    rel = lambda a: float((a - w).norm() / w.norm())  # noqa: E731
    assert rel(scaled) < 0.04 < 0.2 < rel(plain), (rel(scaled), rel(plain))


def test_the_layer_matches_torchs_linear_on_the_dequantised_weight_and_saves_only_codes():
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48).to(torch.bfloat16).requires_grad_(False)
    layer.bias.requires_grad_(True)  # a trained bias gets its gradient
    seq = torch.nn.Sequential(layer)
    precision.enable_fp8_base_weights(seq)
    assert isinstance(seq[0], precision.ScaledFp8Linear) and "weight" not in dict(seq.named_parameters())
    assert not {k for k in seq.state_dict() if k.startswith("0.weight")}  # out of checkpoints
    w = precision.dequantise_fp8(seq[0].weight, seq[0].weight_scale, torch.bfloat16)
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = seq(x)
    ref_x = x.detach().clone().requires_grad_(True)
    ref_bias = layer.bias.detach().clone().requires_grad_(True)
    ref = torch.nn.functional.linear(ref_x, w, ref_bias)
    assert torch.equal(y, ref)
    g = torch.randn_like(y)
    y.backward(g)
    ref.backward(g)
    assert torch.allclose(x.grad, ref_x.grad, rtol=1e-2, atol=1e-3)
    assert torch.allclose(layer.bias.grad.float(), ref_bias.grad.float(), rtol=1e-2, atol=1e-2)
    # The backward keeps the 1-byte codes and the scales, never a 16-bit copy of the weight.
    assert {t.dtype for t in saved} == {torch.uint8, torch.uint16}


def test_module_wide_casts_leave_codes_and_scales_alone():
    seq = torch.nn.Sequential(torch.nn.Linear(32, 16)).requires_grad_(False)
    precision.enable_fp8_base_weights(seq)
    codes, scale = seq[0].weight.clone(), seq[0].weight_scale.clone()
    seq.bfloat16()  # what DeepSpeed's bf16 mode does to the whole module
    assert torch.equal(seq[0].weight, codes) and torch.equal(seq[0].weight_scale, scale)
    assert seq[0].bias.dtype == torch.bfloat16
    assert seq(torch.randn(2, 32, dtype=torch.bfloat16)).dtype == torch.bfloat16
