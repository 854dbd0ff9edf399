"""Frozen weights in a cheaper form while a family computes with them: fp8 text encoders, and the
base model with its LoRA switched off.

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
