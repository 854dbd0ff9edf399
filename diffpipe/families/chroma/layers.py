"""Pipeline-parallel layers of family ``chroma``."""

from __future__ import annotations

import torch
from torch import nn

from diffpipe.models.layers import NormOut


class ChromaEmbed(nn.Module):
    """``(packed, sigma, context, txt_ids, img_ids, mask)`` -> ``(hidden, context, mods, cos, sin, mask)``.

    ``mods``: every block's modulation vectors from the approximator, sliced per block below.
    """

    def __init__(self, tr: nn.Module):
        super().__init__()
        self.x_embedder, self.time_text_embed = tr.x_embedder, tr.time_text_embed
        self.distilled_guidance_layer, self.context_embedder = tr.distilled_guidance_layer, tr.context_embedder
        self.pos_embed = tr.pos_embed

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        packed, sigma, context, txt_ids, img_ids, mask = inputs
        hidden = self.x_embedder(packed)
        mods = self.distilled_guidance_layer(self.time_text_embed(sigma.to(hidden.dtype) * 1000))
        cos, sin = self.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
        return (hidden, self.context_embedder(context), mods, cos, sin, mask)


class ChromaDouble(nn.Module):
    def __init__(self, block: nn.Module, index: int, n_double: int, n_single: int):
        super().__init__()
        self.block = block
        img = 3 * n_single + 6 * index
        txt = 3 * n_single + 6 * n_double + 6 * index
        self.img, self.txt = img, txt

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, context, mods, cos, sin, mask = inputs
        temb = torch.cat((mods[:, self.img : self.img + 6], mods[:, self.txt : self.txt + 6]), dim=1)
        context, hidden = self.block(hidden_states=hidden, encoder_hidden_states=context, temb=temb,
                                     image_rotary_emb=(cos, sin), attention_mask=mask)
        return (hidden, context, mods, cos, sin, mask)


class ChromaSingle(nn.Module):
    """A single-stream block on ``[context, hidden]``, split again after (exact: the block sees one sequence)."""

    def __init__(self, block: nn.Module, index: int):
        super().__init__()
        self.block, self.start = block, 3 * index

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, context, mods, cos, sin, mask = inputs
        n = context.shape[1]
        x = self.block(hidden_states=torch.cat([context, hidden], dim=1), temb=mods[:, self.start : self.start + 3],
                       image_rotary_emb=(cos, sin), attention_mask=mask)
        return (x[:, n:], x[:, :n], mods, cos, sin, mask)


class ChromaOut(NormOut):
    """Inputs ``(hidden, context, mods, cos, sin, mask)``: the output norm takes the last two modulations."""

    def conditioning(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return inputs[2][:, -2:]


def chroma_layers(tr: nn.Module) -> list[nn.Module]:
    nd, ns = len(tr.transformer_blocks), len(tr.single_transformer_blocks)
    return [
        ChromaEmbed(tr),
        *(ChromaDouble(b, i, nd, ns) for i, b in enumerate(tr.transformer_blocks)),
        *(ChromaSingle(b, i) for i, b in enumerate(tr.single_transformer_blocks)),
        ChromaOut(tr),
    ]
