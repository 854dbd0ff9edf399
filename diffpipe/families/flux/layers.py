"""Pipeline-parallel layers of family ``flux``."""

from __future__ import annotations

import torch
from torch import nn

from diffpipe.models.layers import BlockLayer, NormOut, _pipe_ready
from diffpipe.models.routing import RoutedStack, gather_tokens


class FluxEmbed(nn.Module):
    """``(hidden, timestep, guidance, pooled, context, txt_ids, img_ids)`` -> ``(hidden, context, temb, cos, sin)``."""

    def __init__(self, tr: nn.Module):
        super().__init__()
        self.x_embedder, self.time_text_embed = tr.x_embedder, tr.time_text_embed
        self.context_embedder, self.pos_embed = tr.context_embedder, tr.pos_embed
        self.guidance_embeds = tr.config.guidance_embeds

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, timestep, guidance, pooled, context, txt_ids, img_ids = inputs
        hidden = self.x_embedder(hidden)
        timestep = timestep.to(hidden.dtype) * 1000
        if self.guidance_embeds:
            temb = self.time_text_embed(timestep, guidance.to(hidden.dtype) * 1000, pooled)
        else:
            temb = self.time_text_embed(timestep, pooled)
        context = self.context_embedder(context)
        cos, sin = self.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
        return _pipe_ready((hidden, context, temb, cos, sin))


class FluxBlock(BlockLayer):
    """A double-stream or single-stream block (both take and return both streams)."""

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, context, temb, cos, sin = inputs
        context, hidden = self.block(hidden_states=hidden, encoder_hidden_states=context, temb=temb,
                                     image_rotary_emb=(cos, sin))
        return (hidden, context, temb, cos, sin)


class FluxOut(NormOut):
    """Inputs ``(hidden, context, temb, rope cos, rope sin)``: the output norm is modulated by ``temb``."""


def flux_layers(tr: nn.Module) -> list[nn.Module]:
    blocks = [*tr.transformer_blocks, *tr.single_transformer_blocks]
    return [FluxEmbed(tr), *(FluxBlock(b) for b in blocks), FluxOut(tr)]


def _route_rope(args: dict, kept: torch.Tensor) -> None:
    """Both block kinds take the rotary embedding of the text tokens, then the image tokens (``cos``, ``sin``:
    ``[text + image, D]``): the text part stays whole, the image part follows the kept tokens."""
    text = args["encoder_hidden_states"].shape[1]
    args["image_rotary_emb"] = tuple(gather_tokens(r, kept, 0, text) for r in args["image_rotary_emb"])


#: Token routing: the double-stream blocks then the single-stream ones (both take and return both streams).
ROUTED = RoutedStack(("transformer_blocks", "single_transformer_blocks"), _route_rope)
