"""Pipeline-parallel layers of family ``wan``."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from diffpipe.models.layers import BlockLayer, _pipe_ready
from diffpipe.models.routing import RoutedStack, gather_tokens


class WanEmbed(nn.Module):
    """``(noisy, timestep, context)`` -> ``(hidden, context, proj, temb, rope_cos, rope_sin, fhw)``.

    ``timestep`` ``[B]`` (``sigma x 1000``); with ``expand_timesteps`` (Wan 2.2 TI2V-5B) it is
    repeated for every latent token, as ``WanPipeline`` does. ``proj``: the blocks' six
    modulation vectors; ``fhw``: the patch grid (frames, h, w) as a tensor, for unpatchifying.
    """

    def __init__(self, tr: nn.Module, expand_timesteps: bool = False):
        super().__init__()
        self.rope, self.patch_embedding, self.condition_embedder = tr.rope, tr.patch_embedding, tr.condition_embedder
        self.patch, self.expand = tuple(tr.config.patch_size), expand_timesteps

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:

        noisy, timestep, context = inputs
        (pt, ph, pw), (b, _, f, h, w) = self.patch, noisy.shape
        cos, sin = self.rope(noisy)
        hidden = self.patch_embedding(noisy).flatten(2).transpose(1, 2).contiguous()
        seq = hidden.shape[1] if self.expand else None
        if seq is not None:
            timestep = timestep[:, None].expand(b, seq).flatten()
        # Only Wan's embedder takes ``timestep_seq_len`` (SkyReels-V2's, sharing these layers, does not).
        per_token = {} if seq is None else {"timestep_seq_len": seq}
        temb, proj, context, _ = self.condition_embedder(timestep, context, None, **per_token)
        proj = proj.unflatten(2, (6, -1)) if seq is not None else proj.unflatten(1, (6, -1))
        fhw = torch.tensor([f // pt, h // ph, w // pw], device=noisy.device)
        return _pipe_ready((hidden, context, proj, temb, cos, sin, fhw))


class WanBlock(BlockLayer):
    def __init__(self, block: nn.Module):
        super().__init__(block)
        # SkyReels-V2's blocks (sharing these layers) also take an attention mask, None for its full attention.
        self.mask = (None,) if "attention_mask" in inspect.signature(block.forward).parameters else ()

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, context, proj, temb, cos, sin, fhw = inputs
        return (self.block(hidden, context, proj, (cos, sin), *self.mask), context, proj, temb, cos, sin, fhw)


class WanOut(nn.Module):
    """Output norm (modulated by ``temb``), projection and unpatchify to ``[B, C, F, h, w]``."""

    def __init__(self, tr: nn.Module):
        super().__init__()
        self.norm_out, self.proj_out, self.scale_shift_table = tr.norm_out, tr.proj_out, tr.scale_shift_table
        self.patch = tuple(tr.config.patch_size)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        hidden, _, _, temb, _, _, fhw = inputs
        table = self.scale_shift_table.to(temb.device)
        if temb.ndim == 3:  # one timestep per token
            shift, scale = (table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
            shift, scale = shift.squeeze(2), scale.squeeze(2)
        else:
            shift, scale = (table + temb.unsqueeze(1)).chunk(2, dim=1)
        hidden = (self.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
        hidden = self.proj_out(hidden)
        (pt, ph, pw), (f, h, w) = self.patch, (int(x) for x in fhw)
        x = hidden.reshape(hidden.shape[0], f, h, w, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return (x.flatten(6, 7).flatten(4, 5).flatten(2, 3),)


def wan_layers(tr: nn.Module, *, expand_timesteps: bool = False) -> list[nn.Module]:
    return [WanEmbed(tr, expand_timesteps), *(WanBlock(b) for b in tr.blocks), WanOut(tr)]


def _route_rope(args: dict, kept: torch.Tensor) -> None:
    """The rotary embedding (``cos``, ``sin``: ``[1, S, 1, D]``) follows the kept tokens; so does the
    modulation when it is per token (``[B, S, 6, D]``: Wan 2.2 TI2V-5B's timestep per token)."""
    args["rotary_emb"] = tuple(gather_tokens(r, kept, 1) for r in args["rotary_emb"])
    if args["temb"].ndim == 4:
        args["temb"] = gather_tokens(args["temb"], kept, 1)


#: Token routing: the blocks (they return the hidden states alone).
ROUTED = RoutedStack(("blocks",), _route_rope, output=None)
