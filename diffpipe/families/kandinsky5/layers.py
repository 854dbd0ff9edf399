"""Pipeline-parallel layers of family ``kandinsky5``.

The embedding layer holds the text stack (the text blocks read only the text, the time embedding and
their rotary table), then one layer per visual block and the output layer. Every prompt of a
micro-batch has the same length (the transformer cannot mask text).
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_kandinsky import fractal_flatten, fractal_unflatten
from torch import nn

from diffpipe.models.layers import BlockLayer, _pipe_ready


class Kandinsky5Embed(nn.Module):
    """``(noisy [B,F,h,w,C], timestep, text, pooled, rope scale [3])`` ->
    ``(visual, text, time, visual rope, grid [B, F, h', w'])``, as the transformer's forward builds them."""

    def __init__(self, tr: nn.Module):
        super().__init__()
        self.tr = tr
        if tr.config.attention_type != "regular":
            raise NotImplementedError("kandinsky5 layers: only regular attention (no sparse 'nabla' parameters)")

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        noisy, timestep, text, pooled, scale = inputs
        tr = self.tr
        text = tr.text_embeddings(text)
        time = tr.time_embeddings(timestep) + tr.pooled_text_embeddings(pooled)
        visual = tr.visual_embeddings(noisy)
        text_rope = tr.text_rope_embeddings(torch.arange(text.shape[1], device=text.device)).unsqueeze(0)
        for block in tr.text_transformer_blocks:
            text = block(text, time, text_rope)
        shape = visual.shape[:-1]
        pos = [torch.arange(n, device=visual.device) for n in shape[1:]]
        rope = tr.visual_rope_embeddings(shape, pos, tuple(float(s) for s in scale.tolist()))
        visual, rope = fractal_flatten(visual, rope, shape, block_mask=False)
        return _pipe_ready((visual, text, time, rope, torch.tensor(shape, device=visual.device)))


class Kandinsky5Block(BlockLayer):
    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        visual, text, time, rope, grid = inputs
        return (self.block(visual, text, time, rope.detach(), None), text, time, rope, grid)


class Kandinsky5Out(nn.Module):
    def __init__(self, tr: nn.Module):
        super().__init__()
        self.out_layer = tr.out_layer

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        visual, text, time, _, grid = inputs
        visual = fractal_unflatten(visual, [int(n) for n in grid], block_mask=False)
        return (self.out_layer(visual, text, time),)


def kandinsky5_layers(tr: nn.Module) -> list[nn.Module]:
    return [Kandinsky5Embed(tr), *(Kandinsky5Block(b) for b in tr.visual_transformer_blocks), Kandinsky5Out(tr)]
