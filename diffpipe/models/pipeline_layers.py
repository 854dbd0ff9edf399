"""Denoisers as a flat sequence of layers, for pipeline parallelism.

Each layer takes a tuple of tensors and returns one (what DeepSpeed's
``PipelineModule`` passes between stages): an embedding layer first, one
layer per UNet or transformer block, a final layer returning ``(prediction,)``.
Running the layers in order equals the denoiser's own ``forward`` (tested).
Layers wrap the denoiser's own submodules, so LoRA layers injected into the
denoiser are inside them.

SD UNet tuple between layers: ``(h, emb, context, *skip_residuals)``; the
residual stack grows through the down blocks and shrinks through the up
blocks. Flux tuple: ``(hidden, context, temb, rope_cos, rope_sin)``.
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


# -- SD-style UNet ----------------------------------------------------------------------
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


class UNetDown(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        h, emb, context, *res = inputs
        if getattr(self.block, "has_cross_attention", False):
            h, new = self.block(hidden_states=h, temb=emb, encoder_hidden_states=context)
        else:
            h, new = self.block(hidden_states=h, temb=emb)
        return (h, emb, context, *res, *new)


class UNetMid(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        h, emb, context, *res = inputs
        if getattr(self.block, "has_cross_attention", False):
            h = self.block(h, emb, encoder_hidden_states=context)
        else:
            h = self.block(h, emb)
        return (h, emb, context, *res)


class UNetUp(nn.Module):
    """Consumes as many skip residuals as the block has resnets (from the end of the stack)."""

    def __init__(self, block: nn.Module, is_final: bool):
        super().__init__()
        self.block, self.is_final = block, is_final

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        h, emb, context, *res = inputs
        n = len(self.block.resnets)
        skips, res = tuple(res[-n:]), res[:-n]
        # Like UNet2DConditionModel: force the upsampled size when it is not a clean doubling.
        size = res[-1].shape[2:] if res and not self.is_final else None
        if getattr(self.block, "has_cross_attention", False):
            h = self.block(hidden_states=h, temb=emb, res_hidden_states_tuple=skips,
                           encoder_hidden_states=context, upsample_size=size)
        else:
            h = self.block(hidden_states=h, temb=emb, res_hidden_states_tuple=skips, upsample_size=size)
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


# -- Flux-style transformer --------------------------------------------------------------
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


class FluxBlock(nn.Module):
    """A double-stream or single-stream block (both take and return both streams)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, context, temb, cos, sin = inputs
        context, hidden = self.block(hidden_states=hidden, encoder_hidden_states=context, temb=temb,
                                     image_rotary_emb=(cos, sin))
        return (hidden, context, temb, cos, sin)


class FluxOut(nn.Module):
    def __init__(self, tr: nn.Module):
        super().__init__()
        self.norm_out, self.proj_out = tr.norm_out, tr.proj_out

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        hidden, _, temb, _, _ = inputs
        return (self.proj_out(self.norm_out(hidden, temb)),)


def flux_layers(tr: nn.Module) -> list[nn.Module]:
    blocks = [*tr.transformer_blocks, *tr.single_transformer_blocks]
    return [FluxEmbed(tr), *(FluxBlock(b) for b in blocks), FluxOut(tr)]


def run_layers(layers: list[nn.Module], inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Run the layers in order (what a pipeline does across stages); returns the prediction."""
    x = inputs
    for layer in layers:
        x = layer(x)
    return x[0]
