"""Pipeline-parallel layer lists of the transformer families beyond Flux (see ``pipeline_layers``).

SD3 tuple between layers: ``(hidden, context, temb, size)``, ``size`` the
latent ``(h, w)`` as a tensor (stages pass tensors only). The last joint
block returns no context (``context_pre_only``): the previous one is passed
on unchanged, so every layer's output has the same structure.
"""

from __future__ import annotations

import torch
from torch import nn


class SD3Embed(nn.Module):
    """``(noisy, timestep, pooled, context)`` -> ``(hidden, context, temb, size)``."""

    def __init__(self, tr: nn.Module):
        super().__init__()
        self.pos_embed, self.time_text_embed, self.context_embedder = (
            tr.pos_embed, tr.time_text_embed, tr.context_embedder)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        noisy, timestep, pooled, context = inputs
        size = torch.tensor(noisy.shape[-2:], device=noisy.device)
        hidden = self.pos_embed(noisy).contiguous()
        return (hidden, self.context_embedder(context), self.time_text_embed(timestep, pooled), size)


class SD3Block(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, context, temb, size = inputs
        new_context, hidden = self.block(hidden_states=hidden, encoder_hidden_states=context, temb=temb)
        return (hidden, context if new_context is None else new_context, temb, size)


class SD3Out(nn.Module):
    def __init__(self, tr: nn.Module):
        super().__init__()
        self.norm_out, self.proj_out = tr.norm_out, tr.proj_out
        self.patch, self.channels = tr.config.patch_size, tr.out_channels

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        hidden, _, temb, size = inputs
        x = self.proj_out(self.norm_out(hidden, temb))
        p, c = self.patch, self.channels
        h, w = int(size[0]) // p, int(size[1]) // p
        x = torch.einsum("nhwpqc->nchpwq", x.reshape(x.shape[0], h, w, p, p, c))
        return (x.reshape(x.shape[0], c, h * p, w * p),)


def sd3_layers(tr: nn.Module) -> list[nn.Module]:
    return [SD3Embed(tr), *(SD3Block(b) for b in tr.transformer_blocks), SD3Out(tr)]


# -- Qwen-Image ------------------------------------------------------------------------------
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


class QwenBlock(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, context, mask, temb, img_rope, txt_rope = inputs
        rope = (torch.view_as_complex(img_rope), torch.view_as_complex(txt_rope))
        context, hidden = self.block(hidden_states=hidden, encoder_hidden_states=context,
                                     encoder_hidden_states_mask=mask, temb=temb, image_rotary_emb=rope)
        return (hidden, context, mask, temb, img_rope, txt_rope)


class QwenOut(nn.Module):
    def __init__(self, tr: nn.Module):
        super().__init__()
        self.norm_out, self.proj_out = tr.norm_out, tr.proj_out

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        hidden, _, _, temb, _, _ = inputs
        return (self.proj_out(self.norm_out(hidden, temb)),)


def qwen_layers(tr: nn.Module) -> list[nn.Module]:
    return [QwenEmbed(tr), *(QwenBlock(b) for b in tr.transformer_blocks), QwenOut(tr)]


# -- Chroma --------------------------------------------------------------------------------
class ChromaEmbed(nn.Module):
    """``(packed, sigma, context, txt_ids, img_ids, mask)`` -> ``(hidden, context, mods, cos, sin, mask)``.

    ``mods``: every block's modulation vectors from the approximator, sliced per block below.
    """

    def __init__(self, tr: nn.Module):
        super().__init__()
        self.x_embedder, self.time_text_embed = tr.x_embedder, tr.time_text_embed
        self.distilled_guidance_layer, self.context_embedder = tr.distilled_guidance_layer, tr.context_embedder
        self.pos_embed = tr.pos_embed

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        packed, sigma, context, txt_ids, img_ids, mask = inputs
        hidden = self.x_embedder(packed)
        mods = self.distilled_guidance_layer(self.time_text_embed(sigma.to(hidden.dtype) * 1000))
        cos, sin = self.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
        return (hidden, self.context_embedder(context), mods, cos, sin, mask)


class ChromaDouble(nn.Module):
    def __init__(self, block: nn.Module, index: int, n_double: int, n_single: int):
        super().__init__()
        self.block = block
        img = 3 * n_single + 6 * index
        txt = 3 * n_single + 6 * n_double + 6 * index
        self.img, self.txt = img, txt

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, context, mods, cos, sin, mask = inputs
        temb = torch.cat((mods[:, self.img : self.img + 6], mods[:, self.txt : self.txt + 6]), dim=1)
        context, hidden = self.block(hidden_states=hidden, encoder_hidden_states=context, temb=temb,
                                     image_rotary_emb=(cos, sin), attention_mask=mask)
        return (hidden, context, mods, cos, sin, mask)


class ChromaSingle(nn.Module):
    """A single-stream block on ``[context, hidden]``, split again after (exact: the block sees one sequence)."""

    def __init__(self, block: nn.Module, index: int):
        super().__init__()
        self.block, self.start = block, 3 * index

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, context, mods, cos, sin, mask = inputs
        n = context.shape[1]
        x = self.block(hidden_states=torch.cat([context, hidden], dim=1), temb=mods[:, self.start : self.start + 3],
                       image_rotary_emb=(cos, sin), attention_mask=mask)
        return (x[:, n:], x[:, :n], mods, cos, sin, mask)


class ChromaOut(nn.Module):
    def __init__(self, tr: nn.Module):
        super().__init__()
        self.norm_out, self.proj_out = tr.norm_out, tr.proj_out

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        hidden, _, mods, _, _, _ = inputs
        return (self.proj_out(self.norm_out(hidden, mods[:, -2:])),)


def chroma_layers(tr: nn.Module) -> list[nn.Module]:
    nd, ns = len(tr.transformer_blocks), len(tr.single_transformer_blocks)
    return [
        ChromaEmbed(tr),
        *(ChromaDouble(b, i, nd, ns) for i, b in enumerate(tr.transformer_blocks)),
        *(ChromaSingle(b, i) for i, b in enumerate(tr.single_transformer_blocks)),
        ChromaOut(tr),
    ]


# -- HiDream-I1 ------------------------------------------------------------------------------
# Tuple: (hidden, context, llama, temb, rope, mask, img_sizes, n_img). ``llama``: the projected
# Llama states each block reads, stacked; ``mask``: the padding mask of non-square inputs, an
# empty tensor for none; ``n_img``: image tokens (a tensor). Double blocks update the image
# tokens and the joint text; the first single block joins them into one sequence.
def _mask(mask: torch.Tensor) -> torch.Tensor | None:
    return None if mask.numel() == 0 else mask


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
        hidden, context = self.block(hidden_states=hidden, hidden_states_masks=_mask(mask),
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
                            hidden_states_masks=_mask(mask), encoder_hidden_states=None, temb=temb,
                            image_rotary_emb=rope)[:, :n]
        return (hidden, context, llama, temb, rope, mask, img_sizes, n_img)


class HiDreamOut(nn.Module):
    def __init__(self, tr: nn.Module):
        super().__init__()
        self.tr = [tr]
        self.final_layer = tr.final_layer

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


# -- Wan (2.1, 2.2) --------------------------------------------------------------------------
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
        from diffpipe.models.pipeline_layers import _pipe_ready

        noisy, timestep, context = inputs
        (pt, ph, pw), (b, _, f, h, w) = self.patch, noisy.shape
        cos, sin = self.rope(noisy)
        hidden = self.patch_embedding(noisy).flatten(2).transpose(1, 2).contiguous()
        seq = hidden.shape[1] if self.expand else None
        if seq is not None:
            timestep = timestep[:, None].expand(b, seq).flatten()
        temb, proj, context, _ = self.condition_embedder(timestep, context, None, timestep_seq_len=seq)
        proj = proj.unflatten(2, (6, -1)) if seq is not None else proj.unflatten(1, (6, -1))
        fhw = torch.tensor([f // pt, h // ph, w // pw], device=noisy.device)
        return _pipe_ready((hidden, context, proj, temb, cos, sin, fhw))


class WanBlock(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, context, proj, temb, cos, sin, fhw = inputs
        return (self.block(hidden, context, proj, (cos, sin)), context, proj, temb, cos, sin, fhw)


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


# -- CogView4 --------------------------------------------------------------------------------
class CogView4Embed(nn.Module):
    """``(noisy, timestep, context, original_size, target_size, crop_coords)`` ->
    ``(hidden, context, temb, rope_cos, rope_sin, hw)``; ``hw`` the latent ``(h, w)`` as a tensor.

    Every prompt of the micro-batch has the same length (the transformer cannot mask text).
    """

    def __init__(self, tr: nn.Module):
        super().__init__()
        self.rope, self.patch_embed, self.time_condition_embed = tr.rope, tr.patch_embed, tr.time_condition_embed

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        from diffpipe.models.pipeline_layers import _pipe_ready

        noisy, timestep, context, original, target, crop = inputs
        cos, sin = self.rope(noisy)
        hidden, context = self.patch_embed(noisy, context)
        temb = torch.nn.functional.silu(self.time_condition_embed(timestep, original, target, crop, hidden.dtype))
        hw = torch.tensor(noisy.shape[-2:], device=noisy.device)
        return _pipe_ready((hidden, context, temb, cos, sin, hw))


class CogView4Block(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

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


# -- Cosmos-Predict2 -------------------------------------------------------------------------
# Tuple: (hidden, context, embedded_timestep, temb, rope_cos, rope_sin, extra_pos, fhw); ``extra_pos``
# the learnable position embedding (an empty tensor for models without one, as Cosmos-Predict2),
# ``fhw`` the patch grid (frames, h, w) as a tensor.
class CosmosEmbed(nn.Module):
    """``(noisy [B,C,F,h,w], timestep [B], context, padding_mask [1,1,H,W])`` -> the tuple above."""

    def __init__(self, tr: nn.Module):
        super().__init__()
        if tr.config.controlnet_block_every_n or tr.config.img_context_dim_in:
            raise NotImplementedError("cosmos layers: control or image-context variants are not supported")
        self.rope, self.learnable_pos_embed, self.patch_embed = tr.rope, tr.learnable_pos_embed, tr.patch_embed
        self.time_embed = tr.time_embed
        self.crossattn_proj = getattr(tr, "crossattn_proj", None)
        self.concat_padding_mask, self.patch = tr.config.concat_padding_mask, tuple(tr.config.patch_size)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        from diffpipe.models.pipeline_layers import _pipe_ready

        noisy, timestep, context, padding_mask = inputs
        b, _, f, h, w = noisy.shape
        if self.concat_padding_mask:  # the model resizes with torchvision's NEAREST: this interpolation
            resized = torch.nn.functional.interpolate(padding_mask, size=[h, w], mode="nearest")
            noisy = torch.cat([noisy, resized.unsqueeze(2).repeat(b, 1, f, 1, 1)], dim=1)
        cos, sin = self.rope(noisy)
        extra = self.learnable_pos_embed(noisy) if self.learnable_pos_embed is not None else None
        hidden = self.patch_embed(noisy).flatten(1, 3)
        temb, embedded = self.time_embed(hidden, timestep)
        if self.crossattn_proj is not None:
            context = self.crossattn_proj(context)
        pt, ph, pw = self.patch
        fhw = torch.tensor([f // pt, h // ph, w // pw], device=noisy.device)
        extra = torch.empty(0, device=hidden.device) if extra is None else extra
        return _pipe_ready((hidden, context, embedded, temb, cos, sin, extra, fhw))


class CosmosBlock(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, context, embedded, temb, cos, sin, extra, fhw = inputs
        hidden = self.block(hidden, context, embedded, temb, (cos, sin), _mask(extra))
        return (hidden, context, embedded, temb, cos, sin, extra, fhw)


class CosmosOut(nn.Module):
    """Output norm, projection and Cosmos' unpatchify to ``[B, C, F, h, w]``."""

    def __init__(self, tr: nn.Module):
        super().__init__()
        self.norm_out, self.proj_out, self.patch = tr.norm_out, tr.proj_out, tuple(tr.config.patch_size)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        hidden, _, embedded, temb, _, _, _, fhw = inputs
        hidden = self.proj_out(self.norm_out(hidden, embedded, temb))
        (pt, ph, pw), (f, h, w) = self.patch, (int(x) for x in fhw)
        hidden = hidden.unflatten(2, (ph, pw, pt, -1)).unflatten(1, (f, h, w))
        x = hidden.permute(0, 7, 1, 6, 2, 4, 3, 5)  # as the transformer unpatchifies
        return (x.flatten(6, 7).flatten(4, 5).flatten(2, 3),)


def cosmos_layers(tr: nn.Module) -> list[nn.Module]:
    return [CosmosEmbed(tr), *(CosmosBlock(b) for b in tr.transformer_blocks), CosmosOut(tr)]


# -- Lumina Image 2.0 --------------------------------------------------------------------------
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
        from diffpipe.models.pipeline_layers import _pipe_ready

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


class Lumina2Block(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

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
