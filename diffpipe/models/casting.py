"""Frozen weights in a cheaper form while a family computes with them: fp8 text encoders, the base model
with its LoRA switched off, and the scaled-fp8 Linear layer (:class:`ScaledFp8Linear`) that
``train.base_weights: fp8`` and fp8-scaled single-file checkpoints store the denoiser's weights in.

A convolution saves its weight tensor itself for the backward pass, and diffusers' layerwise casting
hook puts the float8 storage back into that very tensor after the forward, so convolutions stay in
the compute dtype (``diffpipe.training.precision`` explains the denoiser's case).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from diffusers.hooks import apply_layerwise_casting
from peft.tuners.tuners_utils import BaseTunerLayer

#: Layers fp8 storage keeps in the compute dtype by class (module docstring).
FP8_SKIPPED_CLASSES = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)

#: What fp8 text encoders keep in their compute dtype besides diffusers' defaults (norms): embeddings
#: (by class and name) and a language model head, which shares its weight with the token embedding.
FP8_TEXT_SKIPPED_PATTERNS = ("norm", "embed", "lm_head")


def enable_fp8_text_encoder(encoder: torch.nn.Module, compute: torch.dtype) -> None:
    """Store a frozen text encoder's weights in float8_e4m3fn, cast to ``compute`` layer by layer for each
    forward (diffusers' ``apply_layerwise_casting``, which also works on transformers models); norms,
    embeddings, a tied ``lm_head``, convolutions (a vision tower's patch embedding) and the modules the
    model itself keeps in float32 (``_keep_in_fp32_modules``: T5's ``wo``, which casts its input to its
    weight's dtype) keep ``compute``."""
    kept = tuple(rf"(^|\.){name}$" for name in getattr(encoder, "_keep_in_fp32_modules", None) or ())
    apply_layerwise_casting(encoder, storage_dtype=torch.float8_e4m3fn, compute_dtype=compute,
                            skip_modules_pattern=FP8_TEXT_SKIPPED_PATTERNS + kept,
                            skip_modules_classes=(*FP8_SKIPPED_CLASSES, torch.nn.Embedding))


@contextlib.contextmanager
def adapters_disabled(module: torch.nn.Module) -> Iterator[None]:
    """``module`` (or a DeepSpeed engine holding it) as its base model: every PEFT adapter layer
    switched off for the block, then on again with each parameter's ``requires_grad`` as it was."""
    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer) and not m.disable_adapters]
    trained = {p: p.requires_grad for layer in layers for p in layer.parameters()}
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for p, flag in trained.items():
            p.requires_grad_(flag)


#: float8_e4m3fn's largest finite value.
FP8_MAX = 448.0


class _ScaledFp8Matmul(torch.autograd.Function):
    """``x @ (codes * scale).T + bias``, saving the codes (1 byte a weight) rather than the dequantised weight."""

    @staticmethod
    def forward(ctx, x, codes, scale, bias):
        ctx.save_for_backward(codes, scale)
        ctx.bias_grad = bias is not None and bias.requires_grad
        return torch.nn.functional.linear(x, dequantise_fp8(codes, scale, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        codes, scale = ctx.saved_tensors
        grad_x = grad @ dequantise_fp8(codes, scale, grad.dtype) if ctx.needs_input_grad[0] else None
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.bias_grad else None
        return grad_x, None, None, grad_bias


#: The float dtype behind each integer view a row scale is stored as: bf16 scales (``train.base_weights: fp8``
#: quantising a 16-bit weight) and float32 scales (a ComfyUI fp8-scaled file's, kept as the file has them).
SCALE_VIEWS = {torch.uint16: torch.bfloat16, torch.int32: torch.float32}


def dequantise_fp8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight in ``dtype`` from its e4m3 codes (uint8 view) and row scales (a :data:`SCALE_VIEWS` view):
    one ``dtype`` copy, scaled in place."""
    return codes.view(torch.float8_e4m3fn).to(dtype).mul_(scale.view(SCALE_VIEWS[scale.dtype]).to(dtype))


class ScaledFp8Linear(torch.nn.Linear):
    """A frozen ``nn.Linear`` whose ``weight`` buffer holds e4m3 codes (uint8 view) and ``weight_scale`` a
    scale per output channel, shape ``[rows, 1]`` (bf16 as a uint16 view, or float32 as an int32 view: integer
    views, so module-wide dtype casts leave them alone); a subclass, so PEFT still wraps it as a Linear.
    ``train.base_weights: fp8`` makes them from 16-bit weights (``diffpipe.training.precision``), the
    fp8-scaled single-file loader (:mod:`diffpipe.models.comfy_fp8`) from a file's codes and scales."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ScaledFp8Matmul.apply(x, self.weight, self.weight_scale, self.bias)
