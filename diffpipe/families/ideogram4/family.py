"""Family ``ideogram4``: Ideogram 4, a single-stream DiT over one packed text + image sequence.

Components and names follow ``Ideogram4Pipeline``: ``vae`` (FLUX.2's AutoencoderKLFlux2: the latent mode
patchified 2x2 with the channels ordered (row offset, column offset, channel), as the pipeline's decode
unpacks them, and normalised by the VAE's batch-norm statistics), ``text_encoder`` (Qwen3VLModel: each
caption as one user turn in the chat template, left-padded, the hidden states of 13 decoder layers
concatenated per token by the pipeline's own ``_get_text_encoder_hidden_states``) + ``tokenizer``,
``transformer`` (Ideogram4Transformer2DModel, the one trained), ``unconditional_transformer`` (a second
transformer of the same class that denoises without text for the asymmetric guidance: loaded for
sampling, never trained), ``scheduler`` (flow matching, stepped along the pipeline's logit-normal sigmas).

The transformer sees ``[left padding][caption][image tokens]`` with the pipeline's positions, segments and
token roles (``_prepare_ids``); padding sits in its own segment, so the pad length changes nothing and
training pads to the batch's longest caption. Time runs the other way (the transformer sees ``1 - sigma``)
and it predicts ``x0 - noise``: the pipeline steps with ``-v``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Ideogram4Pipeline,
    Ideogram4Transformer2DModel,
)
from transformers import AutoTokenizer, PreTrainedTokenizerBase, Qwen3VLConfig, Qwen3VLModel

from diffpipe.config import SampleConfig
from diffpipe.families.flux2_klein.family import TinyBatchNormVae
from diffpipe.families.ideogram4 import flavors
from diffpipe.families.ideogram4.layers import ideogram4_layers
from diffpipe.models import _common as common
from diffpipe.models import targets
from diffpipe.models.base import Family, Prepared
from diffpipe.models.components import Models, TextBundle, TextPart, one_text_encoder
from diffpipe.models.llm_tokenizers import tiny_qwen3_vl_tokenizer

#: The cache's caption length (the pipeline's default is 2048; the pad length does not change its output).
MAX_LENGTH = 512
PATCH = 2  # the pipeline's patch side
UNCONDITIONAL = "unconditional_transformer"


def chat_ids(tokenizer: PreTrainedTokenizerBase, captions: list[str]) -> list[torch.Tensor]:
    """``Ideogram4Pipeline.encode_prompt``'s tokens: each caption as one user turn, the assistant turn opened."""
    out = []
    for caption in captions:
        messages = [{"role": "user", "content": [{"type": "text", "text": caption}]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0])
    return out


def ideogram_tokens(vae: AutoencoderKLFlux2, latents: torch.Tensor) -> torch.Tensor:
    """The VAE's latent mode ``[B, C, h, w]`` as the pipeline's decode reads its tokens: 2x2 patches with the
    channels ordered (row offset, column offset, channel), ``(x - mean) / std`` with the VAE's batch-norm
    statistics and its epsilon; ``[B, 4C, h/2, w/2]``."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 3, 5, 1, 2, 4)
    x = x.reshape(b, PATCH * PATCH * c, h // PATCH, w // PATCH)
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(x)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(x)
    return (x - mean) / std


def _pack(x: torch.Tensor, b: int, c: int, h: int, w: int) -> torch.Tensor:
    """``[B, C, h, w]`` -> ``[B, h*w, C]``, row-major tokens (the latents are patchified already)."""
    return x.permute(0, 2, 3, 1).reshape(b, h * w, c)


class Ideogram4Family(TinyBatchNormVae, Family):
    models = Models(AutoencoderKLFlux2, Ideogram4Transformer2DModel, FlowMatchEulerDiscreteScheduler,
                    Ideogram4Pipeline, flavors)
    text_parts: ClassVar[dict[str, TextPart]] = one_text_encoder(
        AutoTokenizer, lambda: tiny_qwen3_vl_tokenizer(flavors.TINY_LENGTH), Qwen3VLModel, Qwen3VLConfig,
        flavors.TINY_TEXT,
        "ideogram4.text_encoder", ids=("pad", "eos"), vision=flavors.TINY_VISION, stream="qwen3-vl")
    patch = PATCH
    prompt_tokens = (flavors.TINY_LENGTH, MAX_LENGTH)
    #: The attention projections and the SwiGLU feed-forward of every block.
    default_lora_targets: ClassVar[list[str]] = [
        *targets.attention("attention"), "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]

    def shift_for(self, x0: torch.Tensor) -> float:
        """``exp(mu)`` of the pipeline's resolution-aware schedule: its sigmas are ``sigmoid(mu + std z)`` with
        ``mu = 0.5 log(pixels / 512^2)``, i.e. its base schedule shifted by ``sqrt(pixels) / 512``."""
        side = self.vae_factor * self.patch_size
        return math.sqrt(x0.shape[-2] * side * x0.shape[-1] * side) / 512

    # -- components ------------------------------------------------------------
    def load_unconditional(self) -> Ideogram4Transformer2DModel:
        """The guidance's text-free transformer (``unconditional_transformer``): sampling only."""
        return self._model(self.denoiser_model, UNCONDITIONAL)

    def load_pipeline(self) -> Ideogram4Pipeline:
        return self.pipeline_class(
            vae=self.load_vae(), transformer=self.load_denoiser(), **{UNCONDITIONAL: self.load_unconditional()},
            scheduler=self.inference_scheduler(), **self.load_text_encoders().parts)

    # -- encoding --------------------------------------------------------------
    def encode_pixels(self, vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        """The inverse of the pipeline's decode: its tokens as a grid, ``[B, 4C, 1, h/2, w/2]``."""
        return ideogram_tokens(vae, common.vae_latents(vae, pixels)[:, :, 0])[:, :, None]

    def encode_text(self, encoders: TextBundle, captions: list[str]) -> dict[str, torch.Tensor]:
        """``Ideogram4Pipeline.encode_prompt``'s text features: each caption left-padded to
        ``max_sequence_length`` (a longer one keeps its first tokens: validation reports it), the 13 layers'
        states concatenated per token, padding zeroed; with the token mask."""
        length = encoders.max_sequence_length
        ids = [i[:length] for i in chat_ids(encoders.tokenizer, captions)]
        device = next(encoders.text_encoder.parameters()).device
        tokens = torch.zeros(len(ids), length, dtype=torch.long)
        mask = torch.zeros_like(tokens)
        positions = torch.zeros_like(tokens)
        for b, i in enumerate(ids):
            tokens[b, length - len(i):] = i
            mask[b, length - len(i):] = 1
            positions[b, length - len(i):] = torch.arange(len(i))
        with torch.no_grad():
            layers = Ideogram4Pipeline._get_text_encoder_hidden_states(
                encoders.text_encoder, tokens.to(device), mask.to(device), positions.to(device))
        features = torch.stack(layers, dim=-1).flatten(2).float().cpu()  # [B, L, D x 13], layer fastest
        return {"prompt_embeds": features * mask[..., None], "prompt_embeds_mask": mask.float()}

    def count_tokens(self, encoders: TextBundle, captions: list[str]) -> dict[str, list[int]]:
        return {"qwen3-vl": [len(i) for i in chat_ids(encoders.tokenizer, captions)]}

    # -- training ----------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32) -> Prepared:
        """The pipeline's packed sequence: the batch's captions left-padded to the longest, then the noisy
        image tokens; ``1 - sigma``; positions, segments and roles from ``_prepare_ids``. The target
        ``x0 - noise``, packed."""
        f = self.flow_draw(latents, generator, objective, t, noise, _pack)
        device = f.x0.device
        b, _, rows, cols = f.x0.shape
        embeds = text["prompt_embeds"]
        if embeds.device.type == "meta":  # memory estimates: every caption at full length
            lengths = [embeds.shape[1]] * b
        else:
            lengths = [int(n) for n in text["prompt_embeds_mask"].sum(1).tolist()]
        longest = max(lengths)
        captions = embeds[:, embeds.shape[1] - longest:].to(device=device, dtype=dtype)
        noisy = f.noisy.to(dtype)
        position_ids, segment_ids, indicator = Ideogram4Pipeline._prepare_ids(lengths, rows, cols, longest, device)
        inputs = {
            "hidden_states": torch.cat([noisy.new_zeros(b, longest, noisy.shape[-1]), noisy], dim=1),
            "timestep": (1 - f.sigma).to(dtype),
            "encoder_hidden_states": torch.cat([captions, captions.new_zeros(b, rows * cols, captions.shape[-1])],
                                               dim=1),
            "position_ids": position_ids,
            "segment_ids": segment_ids,
            "indicator": indicator,
        }
        prepared = self.flow_prepared(f, inputs, mask, objective)
        return dataclasses.replace(prepared, target=-prepared.target)

    def predict(self, denoiser: torch.nn.Module, prepared: Prepared) -> torch.Tensor:
        """The forward's image tokens (the sequence's last ones)."""
        out = denoiser(**prepared.inputs, return_dict=False)[0]
        return out[:, -prepared.target.shape[1]:]

    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        """A constant guidance scale (the pipeline's default per-step schedule has 48 entries)."""
        return {**super().sample_kwargs(cfg), "guidance_schedule": None,
                "max_sequence_length": self.max_sequence_length}

    # -- pipeline parallelism ------------------------------------------------------
    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """Embedding (input projections, text conditioning, roles, positions, segment mask), one layer per
        block, output. Input tuple ``(packed sequence, 1 - sigma, caption features, positions, segments,
        roles)``; output ``(image-token prediction,)``."""
        return ideogram4_layers(common.unwrap(denoiser))
