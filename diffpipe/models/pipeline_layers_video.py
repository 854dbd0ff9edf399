"""Pipeline-parallel layer lists of the text-to-video families (see ``pipeline_layers``).

Tuples between layers carry tensors only; sizes the output needs travel as a
small integer tensor ``fhw`` (latent frames, height, width).

- LTX-Video: ``(hidden, context, temb, embedded_t, cos, sin, text_bias)``.
- CogVideoX: ``(hidden, context, emb, cos, sin, fhw)``; empty rope tensors for sin-cos positions.
- HunyuanVideo: ``(hidden, context, temb, mask, cos, sin, fhw)``; ``mask`` the joint attention mask.
- Mochi 1: ``(hidden, context, temb, text_mask, cos, sin, fhw)``.
"""

from __future__ import annotations

import torch
from torch import nn

from diffpipe.models.pipeline_layers import _pipe_ready


class _Block(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block


# -- LTX-Video ---------------------------------------------------------------------------
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


class LTXBlock(_Block):
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


# -- CogVideoX -----------------------------------------------------------------------------
class CogVideoXEmbed(nn.Module):
    """``(noisy [B,F,C,h,w], context, steps, cos, sin)`` -> the CogVideoX tuple."""

    def __init__(self, tr: nn.Module):
        super().__init__()
        if tr.ofs_embedding is not None:
            raise NotImplementedError("cogvideox layers: the image-to-video ofs embedding is not supported")
        self.time_proj, self.time_embedding = tr.time_proj, tr.time_embedding
        self.patch_embed, self.embedding_dropout = tr.patch_embed, tr.embedding_dropout

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        noisy, context, steps, cos, sin = inputs
        emb = self.time_embedding(self.time_proj(steps).to(dtype=noisy.dtype), None)
        hidden = self.embedding_dropout(self.patch_embed(context, noisy))
        n = context.shape[1]
        fhw = torch.tensor([noisy.shape[1], noisy.shape[3], noisy.shape[4]], device=noisy.device)
        return _pipe_ready((hidden[:, n:], hidden[:, :n], emb, cos, sin, fhw))


class CogVideoXBlock(_Block):
    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, context, emb, cos, sin, fhw = inputs
        hidden, context = self.block(
            hidden_states=hidden,
            encoder_hidden_states=context,
            temb=emb,
            image_rotary_emb=(cos, sin) if cos.numel() else None,
        )
        return (hidden, context, emb, cos, sin, fhw)


class CogVideoXOut(nn.Module):
    def __init__(self, tr: nn.Module):
        super().__init__()
        self.norm_final, self.norm_out, self.proj_out = tr.norm_final, tr.norm_out, tr.proj_out
        self.p, self.pt = tr.config.patch_size, tr.config.patch_size_t

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        hidden, _, emb, _, _, fhw = inputs
        x = self.proj_out(self.norm_out(self.norm_final(hidden), temb=emb))
        f, h, w = (int(v) for v in fhw)
        b, p, pt = x.shape[0], self.p, self.pt
        if pt is None:  # as CogVideoXTransformer3DModel unpatchifies
            x = x.reshape(b, f, h // p, w // p, -1, p, p).permute(0, 1, 4, 2, 5, 3, 6).flatten(5, 6).flatten(3, 4)
        else:
            x = x.reshape(b, (f + pt - 1) // pt, h // p, w // p, -1, pt, p, p)
            x = x.permute(0, 1, 5, 4, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(1, 2)
        return (x,)


def cogvideox_layers(tr: nn.Module) -> list[nn.Module]:
    return [CogVideoXEmbed(tr), *(CogVideoXBlock(b) for b in tr.transformer_blocks), CogVideoXOut(tr)]


# -- HunyuanVideo ----------------------------------------------------------------------------
class HunyuanVideoEmbed(nn.Module):
    """``(noisy, timestep, context, text_mask, pooled, guidance)`` -> the HunyuanVideo tuple."""

    def __init__(self, tr: nn.Module):
        super().__init__()
        if tr.config.image_condition_type is not None:
            raise NotImplementedError("hunyuanvideo layers: image-conditioned variants are not supported")
        self.rope, self.time_text_embed = tr.rope, tr.time_text_embed
        self.x_embedder, self.context_embedder = tr.x_embedder, tr.context_embedder
        self.guidance_embeds = tr.config.guidance_embeds

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        noisy, timestep, context, text_mask, pooled, guidance = inputs
        b, _, f, h, w = noisy.shape
        cos, sin = self.rope(noisy)
        temb, _ = self.time_text_embed(timestep, pooled, guidance if self.guidance_embeds else None)
        hidden = self.x_embedder(noisy)
        context = self.context_embedder(context, timestep, text_mask)
        # The joint mask, as the model builds it: image tokens, then the text's real tokens.
        n = hidden.shape[1] + context.shape[1]
        keep = hidden.shape[1] + text_mask.sum(dim=1, dtype=torch.int)
        mask = (torch.arange(n, device=hidden.device)[None] < keep[:, None])[:, None, None]
        fhw = torch.tensor([f, h, w], device=noisy.device)
        return _pipe_ready((hidden, context, temb, mask, cos, sin, fhw))


class HunyuanVideoBlock(_Block):
    """A dual- or single-stream block (both take and return both streams)."""

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, context, temb, mask, cos, sin, fhw = inputs
        hidden, context = self.block(hidden, context, temb, mask, (cos, sin))
        return (hidden, context, temb, mask, cos, sin, fhw)


class HunyuanVideoOut(nn.Module):
    def __init__(self, tr: nn.Module):
        super().__init__()
        self.norm_out, self.proj_out = tr.norm_out, tr.proj_out
        self.p, self.pt = tr.config.patch_size, tr.config.patch_size_t

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        hidden, _, temb, _, _, _, fhw = inputs
        x = self.proj_out(self.norm_out(hidden, temb))
        f, h, w = (int(v) for v in fhw)
        p, pt = self.p, self.pt
        x = x.reshape(x.shape[0], f // pt, h // p, w // p, -1, pt, p, p).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return (x.flatten(6, 7).flatten(4, 5).flatten(2, 3),)


def hunyuan_video_layers(tr: nn.Module) -> list[nn.Module]:
    blocks = [*tr.transformer_blocks, *tr.single_transformer_blocks]
    return [HunyuanVideoEmbed(tr), *(HunyuanVideoBlock(b) for b in blocks), HunyuanVideoOut(tr)]


# -- Mochi 1 ---------------------------------------------------------------------------------
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


class MochiBlock(_Block):
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
