"""Pipeline-parallel layers of family ``hidream``."""

from __future__ import annotations

import torch
from torch import nn

from diffpipe.models.layers import FinalLayer, optional

# Tuple: (hidden, context, llama, temb, rope, mask, img_sizes, n_img). ``llama``: the projected
# Llama states each block reads, stacked; ``mask``: the padding mask of non-square inputs, an
# empty tensor for none; ``n_img``: image tokens (a tensor). Double blocks update the image
# tokens and the joint text; the first single block joins them into one sequence.


class HiDreamEmbed(nn.Module):
    """``(noisy, timesteps, t5, llama [layers, B, L, D], pooled)`` -> the tuple above."""

    def __init__(self, tr: nn.Module):
        super().__init__()
        self.tr = [tr]  # a plain list: the blocks are registered by their own layers
        self.x_embedder, self.t_embedder, self.p_embedder = tr.x_embedder, tr.t_embedder, tr.p_embedder
        self.caption_projection, self.pe_embedder = tr.caption_projection, tr.pe_embedder
        self.llama_layers = list(tr.config.llama_layers)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        noisy, timesteps, t5, llama, pooled = inputs
        b = noisy.shape[0]
        hidden, mask, img_sizes, img_ids = self.tr[0].patchify(noisy)
        hidden = self.x_embedder(hidden)
        temb = self.t_embedder(timesteps, hidden.dtype) + self.p_embedder(pooled)
        states = [self.caption_projection[i](llama[k]).view(b, -1, hidden.shape[-1])
                  for i, k in enumerate(self.llama_layers)]
        t5 = self.caption_projection[-1](t5).view(b, -1, hidden.shape[-1])
        txt_ids = torch.zeros(b, t5.shape[1] + states[-1].shape[1] + states[0].shape[1], 3,
                              device=img_ids.device, dtype=img_ids.dtype)
        rope = self.pe_embedder(torch.cat((img_ids, txt_ids), dim=1))
        context = torch.cat([t5, states[-1]], dim=1)
        mask = torch.empty(0, device=hidden.device) if mask is None else mask
        n_img = torch.tensor(hidden.shape[1], device=hidden.device)
        return (hidden, context, torch.stack(states), temb, rope, mask, img_sizes, n_img)


class HiDreamDouble(nn.Module):
    def __init__(self, block: nn.Module, index: int):
        super().__init__()
        self.block, self.index = block, index

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, context, llama, temb, rope, mask, img_sizes, n_img = inputs
        n = context.shape[1]
        hidden, context = self.block(hidden_states=hidden, hidden_states_masks=optional(mask),
                                     encoder_hidden_states=torch.cat([context, llama[self.index]], dim=1),
                                     temb=temb, image_rotary_emb=rope)
        return (hidden, context[:, :n], llama, temb, rope, mask, img_sizes, n_img)


class HiDreamSingle(nn.Module):
    def __init__(self, block: nn.Module, index: int, first: bool):
        super().__init__()
        self.block, self.index, self.first = block, index, first

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, context, llama, temb, rope, mask, img_sizes, n_img = inputs
        if self.first:  # join the streams, as the model does after its last double block
            if mask.numel():
                ones = torch.ones(mask.shape[0], context.shape[1] + llama.shape[2], device=mask.device,
                                  dtype=mask.dtype)
                mask = torch.cat([mask, ones], dim=1)
            hidden = torch.cat([hidden, context], dim=1)
        n = hidden.shape[1]
        hidden = self.block(hidden_states=torch.cat([hidden, llama[self.index]], dim=1),
                            hidden_states_masks=optional(mask), encoder_hidden_states=None, temb=temb,
                            image_rotary_emb=rope)[:, :n]
        return (hidden, context, llama, temb, rope, mask, img_sizes, n_img)


class HiDreamOut(FinalLayer):
    def __init__(self, tr: nn.Module):
        super().__init__(tr)
        self.tr = [tr]  # a plain list: the blocks are registered by their own layers

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        hidden, _, _, temb, _, _, img_sizes, n_img = inputs
        out = self.final_layer(hidden[:, : int(n_img)], temb)
        # The image layout in train mode too (not the model's padded patches), so the pipeline
        # loss compares the prediction with the target directly.
        return (self.tr[0].unpatchify(out, img_sizes, False),)


def hidream_layers(tr: nn.Module) -> list[nn.Module]:
    nd = len(tr.double_stream_blocks)
    return [
        HiDreamEmbed(tr),
        *(HiDreamDouble(b, i) for i, b in enumerate(tr.double_stream_blocks)),
        *(HiDreamSingle(b, nd + i, i == 0) for i, b in enumerate(tr.single_stream_blocks)),
        HiDreamOut(tr),
    ]
