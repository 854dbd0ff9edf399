"""Pipeline-parallel layers of family ``ideogram4`` (``Ideogram4Transformer2DModel``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_ideogram4 import LLM_TOKEN_INDICATOR, OUTPUT_IMAGE_INDICATOR
from torch import nn

from diffpipe.models.layers import BlockLayer, FinalLayer, _pipe_ready


class Ideogram4Embed(nn.Module):
    """``(packed sequence, 1 - sigma, caption features, positions, segments, roles)`` -> ``(hidden, AdaLN input,
    cos, sin, segment mask (float), roles)``: the forward up to its blocks."""

    def __init__(self, tr: nn.Module):
        super().__init__()
        self.input_proj, self.llm_cond_norm, self.llm_cond_proj = tr.input_proj, tr.llm_cond_norm, tr.llm_cond_proj
        self.t_embedding, self.adaln_proj = tr.t_embedding, tr.adaln_proj
        self.embed_image_indicator, self.rotary_emb = tr.embed_image_indicator, tr.rotary_emb

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, timestep, text, position_ids, segment_ids, indicator = inputs
        text_mask = (indicator == LLM_TOKEN_INDICATOR).to(hidden.dtype).unsqueeze(-1)
        image_mask = (indicator == OUTPUT_IMAGE_INDICATOR).to(hidden.dtype).unsqueeze(-1)
        hidden = self.input_proj(hidden * image_mask) * image_mask
        t_cond = self.t_embedding(timestep)
        if timestep.dim() == 1:
            t_cond = t_cond.unsqueeze(1)
        adaln = F.silu(self.adaln_proj(t_cond))
        hidden = hidden + self.llm_cond_proj(self.llm_cond_norm(text * text_mask)) * text_mask
        hidden = hidden + self.embed_image_indicator((indicator == OUTPUT_IMAGE_INDICATOR).long())
        cos, sin = self.rotary_emb(position_ids)
        mask = (segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)).unsqueeze(1)
        return _pipe_ready((hidden, adaln, cos.to(hidden.dtype), sin.to(hidden.dtype), mask.to(hidden.dtype),
                            indicator))


class Ideogram4Block(BlockLayer):
    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, adaln, cos, sin, mask, indicator = inputs
        hidden = self.block(hidden, mask.bool(), (cos, sin), adaln)
        return (hidden, adaln, cos, sin, mask, indicator)


class Ideogram4Out(FinalLayer):
    """The final layer; the image tokens (the sequence's last ones) as the prediction."""

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        hidden, adaln, *_, indicator = inputs
        images = int((indicator[0] == OUTPUT_IMAGE_INDICATOR).sum())
        return (self.final_layer(hidden, conditioning=adaln)[:, -images:],)


def ideogram4_layers(tr: nn.Module) -> list[nn.Module]:
    return [Ideogram4Embed(tr), *(Ideogram4Block(b) for b in tr.layers), Ideogram4Out(tr)]
