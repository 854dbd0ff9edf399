"""Pipeline-parallel layers of family ``sd``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from diffpipe.models.layers import BlockLayer, _pipe_ready


class UNetEmbed(nn.Module):
    """``(noisy, timesteps, context)`` -> ``(h, emb, context, h)``: time embedding and conv_in."""

    def __init__(self, unet: nn.Module):
        super().__init__()
        self.time_proj, self.time_embedding, self.conv_in = unet.time_proj, unet.time_embedding, unet.conv_in

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        sample, timesteps, context = inputs
        t = self.time_proj(timesteps.expand(sample.shape[0])).to(dtype=sample.dtype)
        emb = self.time_embedding(t)
        h = self.conv_in(sample)
        return _pipe_ready((h, emb, context, h))


class UNetTextTimeEmbed(UNetEmbed):
    """SDXL: ``(noisy, timesteps, context, text_embeds, time_ids)`` -> ``(h, emb, context, h)``.

    The time embedding plus the ``text_time`` embedding of the pooled text and ``add_time_ids``.
    """

    def __init__(self, unet: nn.Module):
        super().__init__(unet)
        self.add_time_proj, self.add_embedding = unet.add_time_proj, unet.add_embedding

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        sample, timesteps, context, text_embeds, time_ids = inputs
        t = self.time_proj(timesteps.expand(sample.shape[0])).to(dtype=sample.dtype)
        emb = self.time_embedding(t)
        time_embeds = self.add_time_proj(time_ids.flatten()).reshape(text_embeds.shape[0], -1)
        emb = emb + self.add_embedding(torch.concat([text_embeds, time_embeds], dim=-1).to(emb.dtype))
        h = self.conv_in(sample)
        return _pipe_ready((h, emb, context, h))


def _run_block(block: nn.Module, h: torch.Tensor, emb: torch.Tensor, context: torch.Tensor, **kwargs: Any) -> Any:
    """A UNet block on ``h``, with the text ``context`` only when it has cross attention."""
    if getattr(block, "has_cross_attention", False):
        kwargs["encoder_hidden_states"] = context
    return block(hidden_states=h, temb=emb, **kwargs)


class UNetDown(BlockLayer):
    """A down block: its outputs join the skip residuals."""

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        h, emb, context, *res = inputs
        h, new = _run_block(self.block, h, emb, context)
        return (h, emb, context, *res, *new)


class UNetMid(BlockLayer):
    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        h, emb, context, *res = inputs
        return (_run_block(self.block, h, emb, context), emb, context, *res)


class UNetUp(BlockLayer):
    """Consumes as many skip residuals as the block has resnets (from the end of the stack)."""

    def __init__(self, block: nn.Module, is_final: bool):
        super().__init__(block)
        self.is_final = is_final

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        h, emb, context, *res = inputs
        n = len(self.block.resnets)
        skips, res = tuple(res[-n:]), res[:-n]
        # Like UNet2DConditionModel: force the upsampled size when it is not a clean doubling.
        size = res[-1].shape[2:] if res and not self.is_final else None
        h = _run_block(self.block, h, emb, context, res_hidden_states_tuple=skips, upsample_size=size)
        return (h, emb, context, *res)


class UNetOut(nn.Module):
    def __init__(self, unet: nn.Module):
        super().__init__()
        self.norm, self.act, self.conv_out = unet.conv_norm_out, unet.conv_act, unet.conv_out

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        h = inputs[0]
        if self.norm is not None:
            h = self.act(self.norm(h))
        return (self.conv_out(h),)


def unet_layers(unet: nn.Module) -> list[nn.Module]:
    kind = unet.config.addition_embed_type
    if kind not in (None, "text_time"):
        raise NotImplementedError(f"unet layers: addition_embed_type {kind!r} is not supported")
    layers: list[nn.Module] = [UNetTextTimeEmbed(unet) if kind == "text_time" else UNetEmbed(unet)]
    layers += [UNetDown(b) for b in unet.down_blocks]
    if unet.mid_block is not None:
        layers.append(UNetMid(unet.mid_block))
    ups = list(unet.up_blocks)
    layers += [UNetUp(b, i == len(ups) - 1) for i, b in enumerate(ups)]
    layers.append(UNetOut(unet))
    return layers
