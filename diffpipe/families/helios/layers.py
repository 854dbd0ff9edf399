"""Pipeline-parallel layers of family ``helios`` (``HeliosTransformer3DModel``).

The first layer runs the forward up to the blocks: the chunk's patch embedding and rotary positions, the
three history windows patched at their scales and put before the chunk, and the timestep modulation
(the history's at timestep 0 with ``zero_history_timestep``, as the forward builds it). The blocks and the
output norm take the chunk's token count, so every history token is attended to but only the chunk is
predicted.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_helios import center_down_sample_3d, pad_for_3d_conv
from torch import nn

from diffpipe.models.layers import BlockLayer, _pipe_ready

#: The history windows in the order the forward puts them before the chunk (each before the previous).
_WINDOWS = (("short", None, None), ("mid", (2, 4, 4), (2, 2, 2)), ("long", (4, 8, 8), (4, 4, 4)))


class HeliosEmbed(nn.Module):
    """``(noisy, timestep, context, chunk indices, short / mid / long indices, short / mid / long history)`` ->
    ``(hidden, context, proj, temb, rope, chunk tokens, fhw)``."""

    def __init__(self, tr: nn.Module):
        super().__init__()
        self.rope, self.patch_embedding, self.condition_embedder = tr.rope, tr.patch_embedding, tr.condition_embedder
        self.patches = nn.ModuleDict({"short": tr.patch_short, "mid": tr.patch_mid, "long": tr.patch_long})
        self.patch, self.zero_history = tuple(tr.config.patch_size), tr.zero_history_timestep

    def _rope(self, indices: torch.Tensor, h: int, w: int, device: torch.device) -> torch.Tensor:
        return self.rope(frame_indices=indices, height=h, width=w, device=device)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        noisy, timestep, context, indices, *rest = inputs
        names = [name for name, _, _ in _WINDOWS]
        window_indices = dict(zip(names, rest[:3], strict=True))
        histories = dict(zip(names, rest[3:], strict=True))
        b = noisy.shape[0]
        hidden = self.patch_embedding(noisy)
        _, _, f, h, w = hidden.shape
        hidden = hidden.flatten(2).transpose(1, 2)
        rope = self._rope(indices, h, w, hidden.device).flatten(2).transpose(1, 2)
        chunk_tokens = hidden.shape[1]
        for name, pad, down in _WINDOWS:
            latents = histories[name]
            if pad is not None:
                latents = pad_for_3d_conv(latents, pad)
            latents = self.patches[name](latents)
            if name == "short":
                h1, w1 = latents.shape[-2:]
            window_rope = self._rope(window_indices[name], h1, w1, hidden.device)
            if down is not None:
                window_rope = center_down_sample_3d(pad_for_3d_conv(window_rope, down), down)
            hidden = torch.cat([latents.flatten(2).transpose(1, 2), hidden], dim=1)
            rope = torch.cat([window_rope.flatten(2).transpose(1, 2), rope], dim=1)
        history_tokens = hidden.shape[1] - chunk_tokens
        temb, proj, context = self.condition_embedder(timestep, context)
        main = chunk_tokens if self.zero_history else hidden.shape[1]
        temb = temb.view(b, 1, -1).expand(b, main, -1)
        proj = proj.unflatten(-1, (6, -1)).view(b, 6, 1, -1).expand(b, 6, main, -1)
        if self.zero_history:
            t0 = torch.zeros(1, dtype=timestep.dtype, device=timestep.device)
            temb0, proj0, _ = self.condition_embedder(t0, context, is_return_encoder_hidden_states=False)
            temb = torch.cat([temb0.unsqueeze(1).expand(b, history_tokens, -1), temb], dim=1)
            proj0 = proj0.unflatten(-1, (6, -1)).view(1, 6, 1, -1).expand(b, -1, history_tokens, -1)
            proj = torch.cat([proj0, proj], dim=2)
        proj = proj.permute(0, 2, 1, 3)
        grid = torch.tensor([f, h, w, chunk_tokens], device=noisy.device)
        return _pipe_ready((hidden.contiguous(), context.contiguous(), proj, temb, rope.contiguous(), grid))


class HeliosBlock(BlockLayer):
    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, context, proj, temb, rope, grid = inputs
        return (self.block(hidden, context, proj, rope, int(grid[3])), context, proj, temb, rope, grid)


class HeliosOut(nn.Module):
    """Output norm over the chunk's tokens (modulated by ``temb``), projection, unpatchify to
    ``[B, C, F, h, w]``."""

    def __init__(self, tr: nn.Module):
        super().__init__()
        self.norm_out, self.proj_out, self.patch = tr.norm_out, tr.proj_out, tuple(tr.config.patch_size)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        hidden, _, _, temb, _, grid = inputs
        f, h, w, chunk_tokens = (int(x) for x in grid)
        hidden = self.proj_out(self.norm_out(hidden, temb, chunk_tokens))
        pt, ph, pw = self.patch
        x = hidden.reshape(hidden.shape[0], f, h, w, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return (x.flatten(6, 7).flatten(4, 5).flatten(2, 3),)


def helios_layers(tr: nn.Module) -> list[nn.Module]:
    return [HeliosEmbed(tr), *(HeliosBlock(b) for b in tr.blocks), HeliosOut(tr)]
