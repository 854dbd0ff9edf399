"""Pipeline-parallel layers of family ``ltxvideo``."""

from __future__ import annotations

import torch
from torch import nn

from diffpipe.models.layers import BlockLayer, _pipe_ready


class LTXEmbed(nn.Module):
    """``(packed, context, timestep, text_mask, fhw, rope_scale)`` -> the LTX tuple."""

    def __init__(self, tr: nn.Module):
        super().__init__()
        self.rope, self.proj_in, self.time_embed = tr.rope, tr.proj_in, tr.time_embed
        self.caption_projection = tr.caption_projection

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, context, timestep, mask, fhw, rope_scale = inputs
        f, h, w = (int(x) for x in fhw)
        cos, sin = self.rope(hidden, f, h, w, tuple(rope_scale.tolist()), None)
        bias = ((1 - mask.to(hidden.dtype)) * -10000.0).unsqueeze(1)  # as the model converts its mask
        b = hidden.shape[0]
        hidden = self.proj_in(hidden)
        temb, embedded = self.time_embed(timestep.flatten(), batch_size=b, hidden_dtype=hidden.dtype)
        temb, embedded = temb.view(b, -1, temb.shape[-1]), embedded.view(b, -1, embedded.shape[-1])
        context = self.caption_projection(context).view(b, -1, hidden.shape[-1])
        return _pipe_ready((hidden, context, temb, embedded, cos, sin, bias))


class LTXBlock(BlockLayer):
    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, context, temb, embedded, cos, sin, bias = inputs
        hidden = self.block(
            hidden_states=hidden,
            encoder_hidden_states=context,
            temb=temb,
            image_rotary_emb=(cos, sin),
            encoder_attention_mask=bias,
        )
        return (hidden, context, temb, embedded, cos, sin, bias)


class LTXOut(nn.Module):
    def __init__(self, tr: nn.Module):
        super().__init__()
        self.scale_shift_table, self.norm_out, self.proj_out = tr.scale_shift_table, tr.norm_out, tr.proj_out

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        hidden, _, _, embedded, _, _, _ = inputs
        shift, scale = (self.scale_shift_table[None, None] + embedded[:, :, None]).unbind(dim=2)
        return (self.proj_out(self.norm_out(hidden) * (1 + scale) + shift),)


def ltx_layers(tr: nn.Module) -> list[nn.Module]:
    return [LTXEmbed(tr), *(LTXBlock(b) for b in tr.transformer_blocks), LTXOut(tr)]
