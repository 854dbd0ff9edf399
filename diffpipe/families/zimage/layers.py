"""Pipeline-parallel layers of family ``zimage``.

The embedding layer runs the transformer's own front half (``patchify_and_embed``, the image and caption
refiners, ``_build_unified_sequence``) exactly as its forward does; the blocks and the output follow.
"""

from __future__ import annotations

import torch
from torch import nn

from diffpipe.models.layers import BlockLayer, _pipe_ready

PATCH, FRAME_PATCH = 2, 1  # the only patch sizes the published models have (the forward's defaults)
KEY = f"{PATCH}-{FRAME_PATCH}"


# Tuple: (unified, freqs, mask, adaln, sizes). ``unified``: each sample's image tokens then its caption
# tokens, zero-padded to the longest; ``freqs``: their rotary table as real pairs (complex tensors do not
# cross stages); ``mask``: [B, S] 1 on real tokens, empty when every sample has the same length (the model
# masks only then); ``adaln``: the timestep embedding; ``sizes``: [B, 3] each image's (F, H, W).
class ZImageEmbed(nn.Module):
    """``(noisy [B, C, h, w], t, caption embeddings [B, L, D], caption mask [B, L])`` -> the tuple above."""

    def __init__(self, tr: nn.Module):
        super().__init__()
        object.__setattr__(self, "tr", tr)  # its helper methods only: not a submodule of this layer
        self.t_embedder, self.x_embedder, self.cap_embedder = tr.t_embedder, tr.all_x_embedder[KEY], tr.cap_embedder
        self.noise_refiner, self.context_refiner = tr.noise_refiner, tr.context_refiner
        self.x_pad_token, self.cap_pad_token = tr.x_pad_token, tr.cap_pad_token

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        noisy, t, captions, keep = inputs
        tr, device = self.tr, noisy.device
        images = list(noisy.unsqueeze(2).unbind(0))
        adaln = self.t_embedder(t * tr.t_scale).type_as(noisy)
        x, caps, sizes, x_pos, cap_pos, x_pad, cap_pad = tr.patchify_and_embed(
            images, [c[k.bool()] for c, k in zip(captions, keep, strict=True)], PATCH, FRAME_PATCH)
        x_lens, cap_lens = [len(i) for i in x], [len(c) for c in caps]
        x = self.x_embedder(torch.cat(x, dim=0))
        x, x_freqs, x_mask, _, _ = tr._prepare_sequence(list(x.split(x_lens)), x_pos, x_pad, self.x_pad_token,
                                                        None, device)
        for layer in self.noise_refiner:
            x = layer(x, x_mask, x_freqs, adaln, None, None, None)
        caps = self.cap_embedder(torch.cat(caps, dim=0))
        caps, cap_freqs, cap_mask, _, _ = tr._prepare_sequence(list(caps.split(cap_lens)), cap_pos, cap_pad,
                                                               self.cap_pad_token, None, device)
        for layer in self.context_refiner:
            caps = layer(caps, cap_mask, cap_freqs)
        unified, freqs, mask, _ = tr._build_unified_sequence(x, x_freqs, x_lens, None, caps, cap_freqs, cap_lens,
                                                             None, None, None, None, None, False, device)
        mask = torch.empty(0, dtype=torch.long, device=device) if mask is None else mask.long()
        sizes = torch.tensor(sizes, device=device)
        return _pipe_ready((unified, torch.view_as_real(freqs).contiguous(), mask, adaln, sizes))


class ZImageBlock(BlockLayer):
    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        unified, freqs, mask, adaln, sizes = inputs
        # Detached: rotary tables are constants (as in the Lumina 2 layers).
        rotary = torch.view_as_complex(freqs.detach().contiguous())
        unified = self.block(unified, mask.bool() if mask.numel() else None, rotary, adaln, None, None, None)
        return (unified, freqs, mask, adaln, sizes)


class ZImageOut(nn.Module):
    """The final layer (modulated by the timestep embedding), each sample's image tokens unpatchified."""

    def __init__(self, tr: nn.Module):
        super().__init__()
        object.__setattr__(self, "tr", tr)
        self.final = tr.all_final_layer[KEY]

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        unified, _, _, adaln, sizes = inputs
        unified = self.final(unified, c=adaln)
        images = self.tr.unpatchify(list(unified.unbind(0)), [tuple(s) for s in sizes.tolist()], PATCH, FRAME_PATCH)
        return (torch.stack(images).squeeze(2),)


def zimage_layers(tr: nn.Module) -> list[nn.Module]:
    return [ZImageEmbed(tr), *(ZImageBlock(b) for b in tr.layers), ZImageOut(tr)]
