"""Shared pieces of the pipeline-parallel layer lists (each family's ``layers.py``).

Each layer takes a tuple of tensors and returns one (what DeepSpeed's
``PipelineModule`` passes between stages): an embedding layer first, one
layer per UNet or transformer block, a final layer returning ``(prediction,)``.
Running the layers in order equals the denoiser's own ``forward`` (tested).
Layers wrap the denoiser's own submodules, so LoRA layers injected into the
denoiser are inside them.
"""

from __future__ import annotations

import torch
from torch import nn


def _pipe_ready(out: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Let every float tensor between stages take part in backward.

    DeepSpeed's pipeline runs backward on every float output it sent; one
    computed only from frozen weights (the time embedding under LoRA) has no
    graph, so it is made a grad-requiring leaf (its gradient is simply unused).
    Outside a pipeline (no grad mode, or a tensor with a graph) nothing changes.
    """
    if not torch.is_grad_enabled():
        return out
    for t in out:
        if t.is_floating_point() and not t.requires_grad and t.grad_fn is None:
            t.requires_grad_(True)
    return out


def run_layers(layers: list[nn.Module], inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Run the layers in order (what a pipeline does across stages); returns the prediction."""
    x = inputs
    for layer in layers:
        x = layer(x)
    return x[0]


class BlockLayer(nn.Module):
    """A pipeline-parallel layer around one block of the denoiser (its ``forward`` unpacks the stage inputs)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block


class FinalLayer(nn.Module):
    """The last pipeline-parallel layer of a denoiser whose output layer is one ``final_layer`` module (its
    ``forward`` picks the image tokens from the stage inputs and returns ``(prediction,)``)."""

    def __init__(self, tr: nn.Module):
        super().__init__()
        self.final_layer = tr.final_layer


def optional(tensor: torch.Tensor) -> torch.Tensor | None:
    """A tensor that travels between stages as an empty one when absent (stages pass tensors only)."""
    return None if tensor.numel() == 0 else tensor


class NormOut(nn.Module):
    """The final layer of most DiTs: ``proj_out(norm_out(hidden, conditioning))`` on the stage inputs.

    Hidden states come first in the inputs; :attr:`COND` is the index of the tensor the output norm is
    modulated by (a subclass with another rule overrides :meth:`conditioning`; one that unpatchifies
    overrides ``forward`` around :meth:`project`).
    """

    COND = 2

    def __init__(self, tr: nn.Module):
        super().__init__()
        self.norm_out, self.proj_out = tr.norm_out, tr.proj_out

    def conditioning(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return inputs[self.COND]

    def project(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.proj_out(self.norm_out(inputs[0], self.conditioning(inputs)))

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (self.project(inputs),)
