"""Pipeline-parallel layers of family ``sd3``."""

from __future__ import annotations

import torch
from torch import nn

from diffpipe.models.layers import BlockLayer, NormOut


class SD3Embed(nn.Module):
    """``(noisy, timestep, pooled, context)`` -> ``(hidden, context, temb, size)``."""

    def __init__(self, tr: nn.Module):
        super().__init__()
        self.pos_embed, self.time_text_embed, self.context_embedder = (
            tr.pos_embed, tr.time_text_embed, tr.context_embedder)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        noisy, timestep, pooled, context = inputs
        size = torch.tensor(noisy.shape[-2:], device=noisy.device)
        hidden = self.pos_embed(noisy).contiguous()
        return (hidden, self.context_embedder(context), self.time_text_embed(timestep, pooled), size)


class SD3Block(BlockLayer):
    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, context, temb, size = inputs
        new_context, hidden = self.block(hidden_states=hidden, encoder_hidden_states=context, temb=temb)
        return (hidden, context if new_context is None else new_context, temb, size)


class SD3Out(NormOut):
    """Inputs ``(hidden, context, temb, size)``: norm, projection, then unpatchify to the latent grid."""

    def __init__(self, tr: nn.Module):
        super().__init__(tr)
        self.patch, self.channels = tr.config.patch_size, tr.out_channels

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        x, size = self.project(inputs), inputs[3]
        p, c = self.patch, self.channels
        h, w = int(size[0]) // p, int(size[1]) // p
        x = torch.einsum("nhwpqc->nchpwq", x.reshape(x.shape[0], h, w, p, p, c))
        return (x.reshape(x.shape[0], c, h * p, w * p),)


def sd3_layers(tr: nn.Module) -> list[nn.Module]:
    return [SD3Embed(tr), *(SD3Block(b) for b in tr.transformer_blocks), SD3Out(tr)]
