"""Pipeline-parallel layers of family ``cogview4``."""

from __future__ import annotations

import torch
from torch import nn

from diffpipe.models.layers import BlockLayer, _pipe_ready


class CogView4Embed(nn.Module):
    """``(noisy, timestep, context, original_size, target_size, crop_coords)`` ->
    ``(hidden, context, temb, rope_cos, rope_sin, hw)``; ``hw`` the latent ``(h, w)`` as a tensor.

    Every prompt of the micro-batch has the same length (the transformer cannot mask text).
    """

    def __init__(self, tr: nn.Module):
        super().__init__()
        self.rope, self.patch_embed, self.time_condition_embed = tr.rope, tr.patch_embed, tr.time_condition_embed

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:

        noisy, timestep, context, original, target, crop = inputs
        cos, sin = self.rope(noisy)
        hidden, context = self.patch_embed(noisy, context)
        temb = torch.nn.functional.silu(self.time_condition_embed(timestep, original, target, crop, hidden.dtype))
        hw = torch.tensor(noisy.shape[-2:], device=noisy.device)
        return _pipe_ready((hidden, context, temb, cos, sin, hw))


class CogView4Block(BlockLayer):
    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, context, temb, cos, sin, hw = inputs
        # Detached: the attention applies the rotation in place, which backward cannot undo
        # once the rotary tensors carry gradients (as they do between pipeline stages).
        hidden, context = self.block(hidden, context, temb, (cos.detach(), sin.detach()))
        return (hidden, context, temb, cos, sin, hw)


class CogView4Out(nn.Module):
    """Output norm (modulated by ``temb``), projection and unpatchify to ``[B, C, h, w]``."""

    def __init__(self, tr: nn.Module):
        super().__init__()
        self.norm_out, self.proj_out, self.patch = tr.norm_out, tr.proj_out, tr.config.patch_size

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        hidden, _, temb, _, _, hw = inputs
        hidden = self.proj_out(self.norm_out(hidden, temb))
        p, (h, w) = self.patch, (int(x) // self.patch for x in hw)
        x = hidden.reshape(hidden.shape[0], h, w, -1, p, p).permute(0, 3, 1, 4, 2, 5)
        return (x.flatten(4, 5).flatten(2, 3),)


def cogview4_layers(tr: nn.Module) -> list[nn.Module]:
    return [CogView4Embed(tr), *(CogView4Block(b) for b in tr.transformer_blocks), CogView4Out(tr)]
