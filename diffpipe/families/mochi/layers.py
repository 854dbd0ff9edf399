"""Pipeline-parallel layers of family ``mochi``."""

from __future__ import annotations

import torch
from torch import nn

from diffpipe.models.layers import BlockLayer, _pipe_ready


class MochiEmbed(nn.Module):
    """``(noisy, timestep, context, text_mask)`` -> the Mochi tuple."""

    def __init__(self, tr: nn.Module):
        super().__init__()
        self.time_embed, self.patch_embed, self.rope = tr.time_embed, tr.patch_embed, tr.rope
        self.pos_frequencies, self.p = tr.pos_frequencies, tr.config.patch_size

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        noisy, timestep, context, mask = inputs
        b, _, f, h, w = noisy.shape
        temb, context = self.time_embed(timestep, context, mask, hidden_dtype=noisy.dtype)
        hidden = self.patch_embed(noisy.permute(0, 2, 1, 3, 4).flatten(0, 1))
        hidden = hidden.unflatten(0, (b, -1)).flatten(1, 2)
        cos, sin = self.rope(
            self.pos_frequencies, f, h // self.p, w // self.p, device=noisy.device, dtype=torch.float32
        )
        fhw = torch.tensor([f, h, w], device=noisy.device)
        return _pipe_ready((hidden, context, temb, mask, cos, sin, fhw))


class MochiBlock(BlockLayer):
    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, context, temb, mask, cos, sin, fhw = inputs
        hidden, context = self.block(
            hidden_states=hidden,
            encoder_hidden_states=context,
            temb=temb,
            encoder_attention_mask=mask,
            image_rotary_emb=(cos, sin),
        )
        return (hidden, context, temb, mask, cos, sin, fhw)


class MochiOut(nn.Module):
    def __init__(self, tr: nn.Module):
        super().__init__()
        self.norm_out, self.proj_out, self.p = tr.norm_out, tr.proj_out, tr.config.patch_size

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        hidden, _, temb, _, _, _, fhw = inputs
        x = self.proj_out(self.norm_out(hidden, temb))
        f, h, w = (int(v) for v in fhw)
        p, b = self.p, x.shape[0]
        x = x.reshape(b, f, h // p, w // p, p, p, -1).permute(0, 6, 1, 2, 4, 3, 5)
        return (x.reshape(b, -1, f, h, w),)


def mochi_layers(tr: nn.Module) -> list[nn.Module]:
    return [MochiEmbed(tr), *(MochiBlock(b) for b in tr.transformer_blocks), MochiOut(tr)]
