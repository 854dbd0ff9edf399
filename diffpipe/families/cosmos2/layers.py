"""Pipeline-parallel layers of family ``cosmos2``."""

from __future__ import annotations

import torch
from torch import nn

from diffpipe.models.layers import BlockLayer, _pipe_ready, optional


# Tuple: (hidden, context, embedded_timestep, temb, rope_cos, rope_sin, extra_pos, fhw); ``extra_pos``
# the learnable position embedding (an empty tensor for models without one, as Cosmos-Predict2),
# ``fhw`` the patch grid (frames, h, w) as a tensor.
class CosmosEmbed(nn.Module):
    """``(noisy [B,C,F,h,w], timestep [B], context, padding_mask [1,1,H,W])`` -> the tuple above."""

    def __init__(self, tr: nn.Module):
        super().__init__()
        if tr.config.controlnet_block_every_n or tr.config.img_context_dim_in:
            raise NotImplementedError("cosmos layers: control or image-context variants are not supported")
        self.rope, self.learnable_pos_embed, self.patch_embed = tr.rope, tr.learnable_pos_embed, tr.patch_embed
        self.time_embed = tr.time_embed
        self.crossattn_proj = getattr(tr, "crossattn_proj", None)
        self.concat_padding_mask, self.patch = tr.config.concat_padding_mask, tuple(tr.config.patch_size)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:

        noisy, timestep, context, padding_mask = inputs
        b, _, f, h, w = noisy.shape
        if self.concat_padding_mask:  # the model resizes with torchvision's NEAREST: this interpolation
            resized = torch.nn.functional.interpolate(padding_mask, size=[h, w], mode="nearest")
            noisy = torch.cat([noisy, resized.unsqueeze(2).repeat(b, 1, f, 1, 1)], dim=1)
        cos, sin = self.rope(noisy)
        extra = self.learnable_pos_embed(noisy) if self.learnable_pos_embed is not None else None
        hidden = self.patch_embed(noisy).flatten(1, 3)
        temb, embedded = self.time_embed(hidden, timestep)
        if self.crossattn_proj is not None:
            context = self.crossattn_proj(context)
        pt, ph, pw = self.patch
        fhw = torch.tensor([f // pt, h // ph, w // pw], device=noisy.device)
        extra = torch.empty(0, device=hidden.device) if extra is None else extra
        return _pipe_ready((hidden, context, embedded, temb, cos, sin, extra, fhw))


class CosmosBlock(BlockLayer):
    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, context, embedded, temb, cos, sin, extra, fhw = inputs
        hidden = self.block(hidden, context, embedded, temb, (cos, sin), optional(extra))
        return (hidden, context, embedded, temb, cos, sin, extra, fhw)


class CosmosOut(nn.Module):
    """Output norm, projection and Cosmos' unpatchify to ``[B, C, F, h, w]``."""

    def __init__(self, tr: nn.Module):
        super().__init__()
        self.norm_out, self.proj_out, self.patch = tr.norm_out, tr.proj_out, tuple(tr.config.patch_size)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        hidden, _, embedded, temb, _, _, _, fhw = inputs
        hidden = self.proj_out(self.norm_out(hidden, embedded, temb))
        (pt, ph, pw), (f, h, w) = self.patch, (int(x) for x in fhw)
        hidden = hidden.unflatten(2, (ph, pw, pt, -1)).unflatten(1, (f, h, w))
        x = hidden.permute(0, 7, 1, 6, 2, 4, 3, 5)  # as the transformer unpatchifies
        return (x.flatten(6, 7).flatten(4, 5).flatten(2, 3),)


def cosmos_layers(tr: nn.Module) -> list[nn.Module]:
    return [CosmosEmbed(tr), *(CosmosBlock(b) for b in tr.transformer_blocks), CosmosOut(tr)]
