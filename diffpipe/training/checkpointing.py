"""Activation checkpointing of all, or of a share of, the denoiser's blocks.

diffusers' models call ``self._gradient_checkpointing_func(block, *args)`` for each
block they run under gradient checkpointing (transformer blocks, a UNet's resnets and
attentions). :class:`PartialCheckpointing` is such a function that checkpoints only
the first ``fraction`` of those blocks in forward order and runs the rest plainly,
keeping their activations: faster than checkpointing everything, less memory than
none. The order is learnt on the first forward pass, which checkpoints every block
(the safe side for memory); from the second on, the share applies.

``train.activation_offload`` runs the training forward under
:func:`offloaded_saves` (torch's ``save_on_cpu``): every tensor autograd saves goes
to CPU memory and comes back when the backward pass unpacks it. torch's
(non-reentrant) checkpoint keeps a block's tensor inputs for the recomputation as
saved tensors too, so with checkpointing they move as well, and the GPU holds one
recomputed block's activations at a time.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


class PartialCheckpointing:
    """A ``gradient_checkpointing_func`` checkpointing the first ``fraction`` of the blocks it is called for."""

    def __init__(self, fraction: float):
        if not 0 < fraction <= 1:
            raise ValueError(f"train.checkpoint_fraction {fraction}: must be in (0, 1]")
        self.fraction = fraction
        self.order: dict[int, int] = {}  # id(block) -> its position in forward order
        self.chosen: int | None = None  # how many blocks are checkpointed, once the order is known

    def end_of_forward(self, *_: Any) -> None:
        """The first forward pass has seen every block: fix how many are checkpointed."""
        if self.chosen is None and self.order:
            self.chosen = math.ceil(self.fraction * len(self.order))

    def __call__(self, block: torch.nn.Module, *args: Any) -> Any:
        position = self.order.setdefault(id(block), len(self.order))
        if self.chosen is None or position < self.chosen:
            return checkpoint(block.__call__, *args, use_reentrant=False)
        return block(*args)


@contextlib.contextmanager
def offloaded_saves(enabled: bool) -> Iterator[None]:
    """With ``enabled``: what autograd saves in this block goes to CPU memory (pinned on CUDA)."""
    if not enabled:
        yield
        return
    with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
        yield


def enable(denoiser: torch.nn.Module, fraction: float = 1.0) -> PartialCheckpointing | None:
    """Turn on activation checkpointing for ``fraction`` of ``denoiser``'s blocks (1: diffusers' own, every block)."""
    if fraction >= 1:
        denoiser.enable_gradient_checkpointing()
        return None
    func = PartialCheckpointing(fraction)
    denoiser.enable_gradient_checkpointing(func)
    denoiser.register_forward_hook(func.end_of_forward)
    return func
