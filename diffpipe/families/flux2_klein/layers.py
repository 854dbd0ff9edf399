"""Pipeline-parallel layers of family ``flux2-klein`` (``Flux2Transformer2DModel``)."""

from __future__ import annotations

import torch
from torch import nn

from diffpipe.models.layers import BlockLayer, NormOut, _pipe_ready


class Flux2Embed(nn.Module):
    """``(tokens, sigma, [guidance,] context, txt_ids, img_ids)`` -> ``(hidden, context, temb, double-block
    image and text modulations, single-block modulation, cos, sin)``: the forward's embedding, shared
    modulations and positions (FLUX.2 modulates every block from three layers outside them); ``guidance``:
    FLUX.2 [dev]'s, as ``flux2`` prepares it."""

    def __init__(self, tr: nn.Module):
        super().__init__()
        self.x_embedder, self.context_embedder = tr.x_embedder, tr.context_embedder
        self.time_guidance_embed, self.pos_embed = tr.time_guidance_embed, tr.pos_embed
        self.mod_img, self.mod_txt = tr.double_stream_modulation_img, tr.double_stream_modulation_txt
        self.mod_single = tr.single_stream_modulation

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if len(inputs) == 6:  # FLUX.2 [dev]: the distilled guidance after sigma
            hidden, timestep, guidance, context, txt_ids, img_ids = inputs
            guidance = guidance.to(hidden.dtype) * 1000
        else:
            (hidden, timestep, context, txt_ids, img_ids), guidance = inputs, None
        temb = self.time_guidance_embed(timestep.to(hidden.dtype) * 1000, guidance)
        text_cos, text_sin = self.pos_embed(txt_ids[0] if txt_ids.ndim == 3 else txt_ids)
        img_cos, img_sin = self.pos_embed(img_ids[0] if img_ids.ndim == 3 else img_ids)
        return _pipe_ready((self.x_embedder(hidden), self.context_embedder(context), temb, self.mod_img(temb),
                            self.mod_txt(temb), self.mod_single(temb), torch.cat([text_cos, img_cos]),
                            torch.cat([text_sin, img_sin])))


class Flux2Double(BlockLayer):
    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, context, temb, mod_img, mod_txt, mod_single, cos, sin = inputs
        context, hidden = self.block(hidden_states=hidden, encoder_hidden_states=context, temb_mod_img=mod_img,
                                     temb_mod_txt=mod_txt, image_rotary_emb=(cos, sin))
        return (hidden, context, temb, mod_img, mod_txt, mod_single, cos, sin)


class Flux2Single(Flux2Double):
    """A single-stream block over ``[text, image]``, split back into the two streams after it (the forward
    concatenates once before the first and splits after the last: the same arithmetic)."""

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, context, temb, mod_img, mod_txt, mod_single, cos, sin = inputs
        context, hidden = self.block(hidden_states=hidden, encoder_hidden_states=context, temb_mod=mod_single,
                                     image_rotary_emb=(cos, sin), split_hidden_states=True)
        return (hidden, context, temb, mod_img, mod_txt, mod_single, cos, sin)


class Flux2Out(NormOut):
    """Inputs ``(hidden, context, temb, ...)``: the output norm is modulated by ``temb``."""


def flux2_layers(tr: nn.Module) -> list[nn.Module]:
    return [Flux2Embed(tr), *(Flux2Double(b) for b in tr.transformer_blocks),
            *(Flux2Single(b) for b in tr.single_transformer_blocks), Flux2Out(tr)]
