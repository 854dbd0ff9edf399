"""Pipeline-parallel layers of family ``lumina2``."""

from __future__ import annotations

import torch
from torch import nn

from diffpipe.models.layers import BlockLayer, _pipe_ready


# Tuple: (joint, temb, rope, mask, lengths, hw). ``joint``: each sample's caption tokens then its
# image tokens, zero-padded to the longest; ``rope``: the joint rotary table as real pairs (complex
# tensors do not cross stages); ``mask``: [B, L] 1 on real tokens, empty when all lengths are equal
# (the model masks only then); ``lengths``: [B, 2] caption and joint token counts; ``hw``: the
# latent (h, w). The refiners (caption and image streams, apart) run in the embedding layer.
class Lumina2Embed(nn.Module):
    """``(noisy, timestep, context, context_mask)`` -> the tuple above."""

    def __init__(self, tr: nn.Module):
        super().__init__()
        self.time_caption_embed, self.rope_embedder = tr.time_caption_embed, tr.rope_embedder
        self.x_embedder, self.context_refiner, self.noise_refiner = tr.x_embedder, tr.context_refiner, tr.noise_refiner

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:

        noisy, timestep, context, mask = inputs
        temb, context = self.time_caption_embed(noisy, timestep, context)
        hidden, cap_rope, img_rope, rope, cap_lens, seq_lens = self.rope_embedder(noisy, mask)
        hidden = self.x_embedder(hidden)
        for layer in self.context_refiner:
            context = layer(context, mask, cap_rope)
        for layer in self.noise_refiner:
            hidden = layer(hidden, None, img_rope, temb)
        joint = hidden.new_zeros(hidden.shape[0], max(seq_lens), hidden.shape[-1])
        for i, (n_cap, n) in enumerate(zip(cap_lens, seq_lens, strict=True)):
            joint[i, :n_cap] = context[i, :n_cap]
            joint[i, n_cap:n] = hidden[i]
        lengths = torch.tensor(list(zip(cap_lens, seq_lens, strict=True)), device=noisy.device)
        mask = torch.empty(0, dtype=torch.long, device=noisy.device)
        if len(set(seq_lens)) > 1:
            mask = (torch.arange(joint.shape[1], device=noisy.device)[None] < lengths[:, 1:]).long()
        hw = torch.tensor(noisy.shape[-2:], device=noisy.device)
        return _pipe_ready((joint, temb, torch.view_as_real(rope).contiguous(), mask, lengths, hw))


class Lumina2Block(BlockLayer):
    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        joint, temb, rope, mask, lengths, hw = inputs
        # Detached: rotary tables are constants (as in the CogView4 layers).
        rotary = torch.view_as_complex(rope.detach().contiguous())
        joint = self.block(joint, mask.bool() if mask.numel() else None, rotary, temb)
        return (joint, temb, rope, mask, lengths, hw)


class Lumina2Out(nn.Module):
    """Output norm (modulated by ``temb``), then each sample's image tokens unpatchified to ``[C, h, w]``."""

    def __init__(self, tr: nn.Module):
        super().__init__()
        self.norm_out, self.patch, self.channels = tr.norm_out, tr.config.patch_size, tr.out_channels

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        joint, temb, _, _, lengths, hw = inputs
        joint = self.norm_out(joint, temb)
        p, (h, w) = self.patch, (int(x) // self.patch for x in hw)
        out = [
            joint[i, n_cap:n].view(h, w, p, p, self.channels).permute(4, 0, 2, 1, 3).flatten(3, 4).flatten(1, 2)
            for i, (n_cap, n) in enumerate(lengths.tolist())
        ]
        return (torch.stack(out),)


def lumina2_layers(tr: nn.Module) -> list[nn.Module]:
    return [Lumina2Embed(tr), *(Lumina2Block(b) for b in tr.layers), Lumina2Out(tr)]
