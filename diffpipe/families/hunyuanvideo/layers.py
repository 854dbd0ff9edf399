"""Pipeline-parallel layers of family ``hunyuanvideo``."""

from __future__ import annotations

import torch
from torch import nn

from diffpipe.models.layers import BlockLayer, NormOut, _pipe_ready


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


class HunyuanVideoBlock(BlockLayer):
    """A dual- or single-stream block (both take and return both streams)."""

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, context, temb, mask, cos, sin, fhw = inputs
        hidden, context = self.block(hidden, context, temb, mask, (cos, sin))
        return (hidden, context, temb, mask, cos, sin, fhw)


class HunyuanVideoOut(NormOut):
    """Inputs ``(hidden, context, temb, ..., fhw)``: norm, projection, then unpatchify to frames."""

    def __init__(self, tr: nn.Module):
        super().__init__(tr)
        self.p, self.pt = tr.config.patch_size, tr.config.patch_size_t

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        x, fhw = self.project(inputs), inputs[6]
        f, h, w = (int(v) for v in fhw)
        p, pt = self.p, self.pt
        x = x.reshape(x.shape[0], f // pt, h // p, w // p, -1, pt, p, p).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return (x.flatten(6, 7).flatten(4, 5).flatten(2, 3),)


def hunyuan_video_layers(tr: nn.Module) -> list[nn.Module]:
    blocks = [*tr.transformer_blocks, *tr.single_transformer_blocks]
    return [HunyuanVideoEmbed(tr), *(HunyuanVideoBlock(b) for b in blocks), HunyuanVideoOut(tr)]
