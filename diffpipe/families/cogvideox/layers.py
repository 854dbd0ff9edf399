"""Pipeline-parallel layers of family ``cogvideox``."""

from __future__ import annotations

import torch
from torch import nn

from diffpipe.models.layers import BlockLayer, _pipe_ready


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


class CogVideoXBlock(BlockLayer):
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
