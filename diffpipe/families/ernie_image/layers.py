"""Pipeline-parallel layers of family ``ernie-image`` (``ErnieImageTransformer2DModel``)."""

from __future__ import annotations

import torch
from torch import nn

from diffpipe.models.layers import BlockLayer, _pipe_ready


class ErnieEmbed(nn.Module):
    """``(latents, timestep, captions, caption lengths)`` -> ``(tokens [S, B, H], rotary, attention mask (float),
    time embedding, shared modulation [B, 6H], latent height and width)``: the forward up to its blocks."""

    def __init__(self, tr: nn.Module):
        super().__init__()
        self.x_embedder, self.text_proj, self.pos_embed = tr.x_embedder, tr.text_proj, tr.pos_embed
        self.time_proj, self.time_embedding, self.adaLN_modulation = tr.time_proj, tr.time_embedding, tr.adaLN_modulation
        self.patch_size = tr.patch_size

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, timestep, text, lens = inputs
        tr = self
        b, _, h, w = hidden.shape
        hp, wp = h // tr.patch_size, w // tr.patch_size
        img = tr.x_embedder(hidden).transpose(0, 1)
        if tr.text_proj is not None and text.numel() > 0:
            text = tr.text_proj(text)
        t = text.shape[1]
        x = torch.cat([img, text.transpose(0, 1)], dim=0).contiguous()
        text_ids = torch.cat([torch.arange(t, device=x.device, dtype=torch.float32).view(1, t, 1).expand(b, -1, -1),
                              torch.zeros((b, t, 2), device=x.device)], dim=-1)
        grid = torch.stack(torch.meshgrid(torch.arange(hp, device=x.device, dtype=torch.float32),
                                          torch.arange(wp, device=x.device, dtype=torch.float32), indexing="ij"),
                           dim=-1).reshape(-1, 2)
        image_ids = torch.cat([lens.float().view(b, 1, 1).expand(-1, hp * wp, -1),
                               grid.view(1, hp * wp, 2).expand(b, -1, -1)], dim=-1)
        rotary = tr.pos_embed(torch.cat([image_ids, text_ids], dim=1))
        valid = torch.arange(t, device=x.device).view(1, t) < lens.view(b, 1)
        mask = torch.cat([torch.ones((b, hp * wp), device=x.device, dtype=torch.bool), valid], dim=1)
        c = tr.time_embedding(tr.time_proj(timestep).to(dtype=x.dtype))
        size = torch.tensor([h, w], device=x.device)
        return _pipe_ready((x, rotary.contiguous(), mask.float(), c, tr.adaLN_modulation(c), size))


class ErnieBlock(BlockLayer):
    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x, rotary, mask, c, mod, size = inputs
        temb = [m.unsqueeze(0).expand(x.shape[0], -1, -1).contiguous() for m in mod.chunk(6, dim=-1)]
        x = self.block(x, rotary, temb, mask.bool()[:, None, None, :])
        return (x, rotary, mask, c, mod, size)


class ErnieOut(nn.Module):
    def __init__(self, tr: nn.Module):
        super().__init__()
        self.final_norm, self.final_linear = tr.final_norm, tr.final_linear
        self.patch, self.channels = tr.patch_size, tr.out_channels

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        x, _, _, c, _, size = inputs
        h, w = int(size[0]), int(size[1])
        p = self.patch
        hp, wp = h // p, w // p
        patches = self.final_linear(self.final_norm(x, c).type_as(x))[: hp * wp].transpose(0, 1)
        b = patches.shape[0]
        out = patches.reshape(b, hp, wp, p, p, self.channels).permute(0, 5, 1, 3, 2, 4)
        return (out.reshape(b, self.channels, h, w),)


def ernie_layers(tr: nn.Module) -> list[nn.Module]:
    return [ErnieEmbed(tr), *(ErnieBlock(b) for b in tr.layers), ErnieOut(tr)]
