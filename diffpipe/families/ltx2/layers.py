"""Pipeline-parallel layers of family ``ltx2``: the video stream with the modalities isolated.

Each block still runs the audio stream (on the one-token placeholder :meth:`LTX2Family.audio_placeholder`
gives the model), so the layers carry it; the cross-modal attention is off (``use_a2v_cross_attention``
and ``use_v2a_cross_attention`` false), as in the loss, so its modulation is never computed.
"""

from __future__ import annotations

import torch
from torch import nn

from diffpipe.models.layers import BlockLayer, _pipe_ready, optional

_EMBEDDERS = ("rope", "audio_rope", "proj_in", "audio_proj_in", "time_embed", "audio_time_embed")
_PROMPT = ("caption_projection", "audio_caption_projection", "prompt_adaln", "audio_prompt_adaln")


def _timestep_embedding(embed: nn.Module, timestep: torch.Tensor, b: int, dtype: torch.dtype):
    temb, embedded = embed(timestep.flatten(), batch_size=b, hidden_dtype=dtype)
    return temb.view(b, -1, temb.shape[-1]), embedded.view(b, -1, embedded.shape[-1])


class LTX2Embed(nn.Module):
    """``(packed, context, timestep, text_mask, (F, h, w), fps, clip timestep)`` -> the block tuple: both streams' states
    and text, their timestep modulations and rotary embeddings, the text bias, the output modulation."""

    def __init__(self, tr: nn.Module):
        super().__init__()
        self.config = tr.config
        for name in (*_EMBEDDERS, *_PROMPT):
            if hasattr(tr, name):
                setattr(self, name, getattr(tr, name))
        self.prompt_modulation = tr.prompt_modulation and tr.config.use_prompt_adaln_single

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, context, timestep, mask, fhw, fps, clip_timestep = inputs
        c, b, device = self.config, hidden.shape[0], hidden.device
        f, h, w = (int(x) for x in fhw)
        cos, sin = self.rope(self.rope.prepare_video_coords(b, f, h, w, device, fps=float(fps)), device=device)
        audio_cos, audio_sin = self.audio_rope(self.audio_rope.prepare_audio_coords(b, 1, device), device=device)
        bias = ((1 - mask.to(hidden.dtype)) * -10000.0).unsqueeze(1)  # as the model converts its mask
        text_width = c.caption_channels if c.use_prompt_embeddings else c.audio_cross_attention_dim
        audio = self.audio_proj_in(hidden.new_zeros(b, 1, c.audio_in_channels))
        audio_context = hidden.new_zeros(b, 1, text_width)
        hidden = self.proj_in(hidden)
        temb, embedded = _timestep_embedding(self.time_embed, timestep, b, hidden.dtype)
        temb_audio, _ = _timestep_embedding(self.audio_time_embed, clip_timestep, b, audio.dtype)
        empty = hidden.new_zeros(0)
        temb_prompt = temb_prompt_audio = empty
        if self.prompt_modulation:  # LTX-2.3: the pipeline passes its timestep as sigma too
            temb_prompt, _ = _timestep_embedding(self.prompt_adaln, clip_timestep, b, hidden.dtype)
            temb_prompt_audio, _ = _timestep_embedding(self.audio_prompt_adaln, clip_timestep, b, audio.dtype)
        if c.use_prompt_embeddings:  # LTX-2.0
            context = self.caption_projection(context).view(b, -1, hidden.shape[-1])
            audio_context = self.audio_caption_projection(audio_context).view(b, -1, audio.shape[-1])
        return _pipe_ready((hidden, audio, context, audio_context, temb, temb_audio, temb_prompt, temb_prompt_audio,
                            cos, sin, audio_cos, audio_sin, bias, embedded))


class LTX2Block(BlockLayer):
    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        (hidden, audio, context, audio_context, temb, temb_audio, temb_prompt, temb_prompt_audio,
         cos, sin, audio_cos, audio_sin, bias, embedded) = inputs
        hidden, audio = self.block(
            hidden_states=hidden, audio_hidden_states=audio, encoder_hidden_states=context,
            audio_encoder_hidden_states=audio_context, temb=temb, temb_audio=temb_audio,
            temb_ca_scale_shift=None, temb_ca_audio_scale_shift=None, temb_ca_gate=None, temb_ca_audio_gate=None,
            temb_prompt=optional(temb_prompt), temb_prompt_audio=optional(temb_prompt_audio),
            video_rotary_emb=(cos, sin), audio_rotary_emb=(audio_cos, audio_sin),
            encoder_attention_mask=bias, audio_encoder_attention_mask=None,
            use_a2v_cross_attention=False, use_v2a_cross_attention=False,
        )
        return (hidden, audio, context, audio_context, temb, temb_audio, temb_prompt, temb_prompt_audio,
                cos, sin, audio_cos, audio_sin, bias, embedded)


class LTX2Out(nn.Module):
    def __init__(self, tr: nn.Module):
        super().__init__()
        self.scale_shift_table, self.norm_out, self.proj_out = tr.scale_shift_table, tr.norm_out, tr.proj_out

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        hidden, embedded = inputs[0], inputs[-1]
        shift, scale = (self.scale_shift_table[None, None] + embedded[:, :, None]).unbind(dim=2)
        return (self.proj_out(self.norm_out(hidden) * (1 + scale) + shift),)


def ltx2_layers(tr: nn.Module) -> list[nn.Module]:
    return [LTX2Embed(tr), *(LTX2Block(b) for b in tr.transformer_blocks), LTX2Out(tr)]
