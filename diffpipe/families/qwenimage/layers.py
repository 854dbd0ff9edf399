"""Pipeline-parallel layers of family ``qwenimage``."""

from __future__ import annotations

import torch
from torch import nn

from diffpipe.models.layers import BlockLayer, NormOut
from diffpipe.models.routing import RoutedStack, gather_tokens


class QwenEmbed(nn.Module):
    """``(packed, timestep, context, mask, fhw)`` -> ``(hidden, context, mask, temb, img_rope, txt_rope)``.

    ``fhw``: the packed latent grid ``(frames, h, w)`` as a tensor; ``mask``: the text mask (bool).
    Qwen-Image itself only (no guidance embedding, no zero-conditioned timestep).
    """

    def __init__(self, tr: nn.Module):
        super().__init__()
        if tr.zero_cond_t or tr.config.guidance_embeds:
            raise NotImplementedError("qwenimage layers: guidance or zero_cond_t variants are not supported")
        self.img_in, self.txt_norm, self.txt_in = tr.img_in, tr.txt_norm, tr.txt_in
        self.time_text_embed, self.pos_embed = tr.time_text_embed, tr.pos_embed

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        packed, timestep, context, mask, fhw = inputs
        hidden = self.img_in(packed)
        temb = self.time_text_embed(timestep.to(hidden.dtype), hidden, None)
        context = self.txt_in(self.txt_norm(context))
        shapes = [[tuple(int(x) for x in fhw)]] * hidden.shape[0]
        img_rope, txt_rope = self.pos_embed(shapes, max_txt_seq_len=context.shape[1], device=hidden.device)
        # The rotary frequencies are complex: stages exchange them as real pairs (NCCL sends no complex).
        img_rope, txt_rope = torch.view_as_real(img_rope), torch.view_as_real(txt_rope)
        return (hidden, context, mask.to(torch.bool), temb, img_rope, txt_rope)


class QwenBlock(BlockLayer):
    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, context, mask, temb, img_rope, txt_rope = inputs
        rope = (torch.view_as_complex(img_rope), torch.view_as_complex(txt_rope))
        context, hidden = self.block(hidden_states=hidden, encoder_hidden_states=context,
                                     encoder_hidden_states_mask=mask, temb=temb, image_rotary_emb=rope)
        return (hidden, context, mask, temb, img_rope, txt_rope)


class QwenOut(NormOut):
    """Inputs ``(hidden, context, mask, temb, image rope, text rope)``: modulated by ``temb``."""

    COND = 3


def qwen_layers(tr: nn.Module) -> list[nn.Module]:
    return [QwenEmbed(tr), *(QwenBlock(b) for b in tr.transformer_blocks), QwenOut(tr)]


def _route_rope(args: dict, kept: torch.Tensor) -> None:
    """The rotary embedding is ``(image [S_img, D], text)``: the image part follows the kept tokens; a
    per-token modulation index (zero-conditioned timestep models) too."""
    image, text = args["image_rotary_emb"]
    args["image_rotary_emb"] = (gather_tokens(image, kept, 0), text)
    if torch.is_tensor(args.get("modulate_index")):
        args["modulate_index"] = gather_tokens(args["modulate_index"], kept, 1)


#: Token routing: the dual-stream blocks (they return ``(text, image)``).
ROUTED = RoutedStack(("transformer_blocks",), _route_rope)
