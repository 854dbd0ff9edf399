"""Pipeline-parallel layers of family ``krea2`` (``Krea2Transformer2DModel``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from diffpipe.models.layers import BlockLayer, FinalLayer, _pipe_ready


class Krea2Embed(nn.Module):
    """``(packed tokens, caption states [B, L, 12, D], sigma, positions, caption mask)`` -> ``(hidden [B, L+N, H],
    time embedding, block modulation, cos, sin, attention mask (float), caption mask (float))``: the forward's
    text fusion, input projections and positions, up to its blocks."""

    def __init__(self, tr: nn.Module):
        super().__init__()
        self.time_embed, self.time_mod_proj, self.text_fusion = tr.time_embed, tr.time_mod_proj, tr.text_fusion
        self.txt_in, self.img_in, self.rotary_emb = tr.txt_in, tr.img_in, tr.rotary_emb

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, text, timestep, position_ids, text_mask = inputs
        b, n, _ = hidden.shape
        temb = self.time_embed(timestep, dtype=hidden.dtype)
        temb_mod = self.time_mod_proj(F.gelu(temb, approximate="tanh"))
        text_mask = text_mask.bool()
        mask = torch.cat([text_mask, text_mask.new_ones((b, n))], dim=1)
        text = self.txt_in(self.text_fusion(text, attention_mask=text_mask[:, None, None, :]))
        hidden = torch.cat([text, self.img_in(hidden)], dim=1)
        cos, sin = self.rotary_emb(position_ids)
        return _pipe_ready((hidden, temb, temb_mod, cos, sin, mask.float(), text_mask.float()))


class Krea2Block(BlockLayer):
    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, temb, temb_mod, cos, sin, mask, text_mask = inputs
        hidden = self.block(hidden, temb_mod, (cos, sin), mask.bool()[:, None, None, :])
        return (hidden, temb, temb_mod, cos, sin, mask, text_mask)


class Krea2Out(FinalLayer):
    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        hidden, temb, *_, text_mask = inputs
        return (self.final_layer(hidden[:, text_mask.shape[1]:], temb),)


def krea2_layers(tr: nn.Module) -> list[nn.Module]:
    return [Krea2Embed(tr), *(Krea2Block(b) for b in tr.transformer_blocks), Krea2Out(tr)]
