"""Family ``cogview4``: CogView4 (6B DiT), GLM-4 text, flow matching with a resolution-dependent shift.

Components and names follow ``CogView4Pipeline``: ``vae`` (AutoencoderKL, 16
channels, factor 8; the pipeline decodes ``latents / scaling_factor`` and
ignores ``shift_factor``, so the cache does too), ``text_encoder`` (GlmModel:
hidden states second from the top, no attention mask) + ``tokenizer``,
``transformer`` (CogView4Transformer2DModel), ``scheduler`` (flow matching;
the shift ``mu`` grows with the square root of the image's token count and is
applied linearly, ``time_shift_type: linear``).

Prompts have their own length. The pipeline tokenizes a prompt without
padding, pads it on the left with the pad token to a multiple of 16 and
encodes that without a mask, so the pad tokens are part of what the
transformer reads. The cache holds each caption encoded exactly so (as the
pipeline encodes one prompt; the sample stage renders prompt by prompt):
right-aligned in a row of ``max_sequence_length`` (rounded up to 16) with
zeros before it, and ``prompt_embeds_mask`` marking its tokens, the
fixed-width-plus-mask layout the qwenimage family uses. A batch is assembled
as the pipeline does it: each prompt's last ``L`` columns, ``L`` its padded
length. The transformer cannot mask text (its attention processor turns a
mask into an additive 0/1 bias, not a mask), so prompts of different lengths
cannot share one padded call without changing what they condition on: the
loss runs the transformer once per distinct length in the batch, and every
item sees exactly the embedding the pipeline gives its prompt.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from diffusers import AutoencoderKL, CogView4Pipeline, CogView4Transformer2DModel, FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.cogview4.pipeline_cogview4 import calculate_shift
from transformers import AutoTokenizer, GlmConfig, GlmModel, PreTrainedTokenizerBase

from diffpipe.config import SampleConfig
from diffpipe.families.cogview4 import flavors
from diffpipe.families.cogview4.layers import cogview4_layers
from diffpipe.models import _common as common
from diffpipe.models import targets
from diffpipe.models.base import Family, Prepared
from diffpipe.models.components import Models, TextBundle, TextPart, one_text_encoder
from diffpipe.models.llm_tokenizers import llm_tokenizer

PAD_MULTIPLE = 16  # the pipeline pads every prompt on the left to a multiple of this
MAX_LENGTH = 512  # tokens kept per prompt (the pipeline allows up to 1024; the cache row is this wide)


def padded_length(n: int) -> int:
    """Prompt tokens after the pipeline's left padding to a multiple of 16."""
    return -(-n // PAD_MULTIPLE) * PAD_MULTIPLE


def tiny_glm_tokenizer(max_length: int) -> PreTrainedTokenizerBase:
    """GLM-4-like: ``[gMASK]`` before every prompt, ``<|endoftext|>`` pads, padding on the left."""
    return llm_tokenizer(
        max_length, bos="[gMASK]", eos="<|user|>", pad="<|endoftext|>", extra=("<sop>",), padding_side="left"
    )


class CogView4Family(Family):
    #: The pipeline's LoRA loader is CogView4LoraLoaderMixin.
    models = Models(AutoencoderKL, CogView4Transformer2DModel, FlowMatchEulerDiscreteScheduler, CogView4Pipeline,
                    flavors)
    text_parts: ClassVar[dict[str, TextPart]] = one_text_encoder(
        AutoTokenizer, lambda: tiny_glm_tokenizer(flavors.TINY_LENGTH), GlmModel, GlmConfig, flavors.TINY_GLM,
        "cogview4.text_encoder", stream="glm")
    min_pixel_multiple = 16  # the pipeline refuses sides not divisible by 16
    prompt_tokens = (flavors.TINY_LENGTH, MAX_LENGTH)
    #: The attention projections of every block (one joint attention over text
    #: and image tokens) and the feed-forward both streams share.
    default_lora_targets: ClassVar[list[str]] = [*targets.attention("attn1"), *targets.feed_forward()]

    def shift_for(self, x0: torch.Tensor) -> float:
        return self.timestep_shift(x0.shape[-2] * x0.shape[-1] // self.patch_size**2)

    def timestep_shift(self, image_seq_len: int) -> float:
        """The pipeline scheduler's shift ``s`` at this many image tokens (``sigma' = s t / (1 + (s-1) t)``).

        ``mu`` as ``CogView4Pipeline`` computes it; linear time shift: ``s = mu``; exponential: ``exp(mu)``.
        """
        c = self._scheduler_config
        if not c.get("use_dynamic_shifting", False):
            return float(c.get("shift", 1.0))
        mu = calculate_shift(
            image_seq_len, c.get("base_image_seq_len", 256), c.get("base_shift", 0.25), c.get("max_shift", 0.75)
        )
        return mu if c.get("time_shift_type", "exponential") == "linear" else math.exp(mu)

    # -- encoding --------------------------------------------------------------
    def encode_text(self, encoders: TextBundle, captions: list[str]) -> dict[str, torch.Tensor]:
        """Each caption as ``CogView4Pipeline._get_glm_embeds`` encodes it alone, right-aligned in a fixed row.

        Captions of the same padded length are encoded together: left-padded with
        the pad token to that length and unmasked, their ids are exactly the
        pipeline's for each one alone.
        """
        tok, enc = encoders.tokenizer, encoders.text_encoder
        width = padded_length(encoders.max_sequence_length)
        rows = [
            tok(c, truncation=True, max_length=encoders.max_sequence_length, add_special_tokens=True).input_ids
            for c in captions
        ]
        groups: dict[int, list[int]] = {}
        for i, ids in enumerate(rows):
            groups.setdefault(padded_length(len(ids)), []).append(i)
        param = next(enc.parameters())
        embeds = torch.zeros(len(captions), width, enc.config.hidden_size, device=param.device)
        keep = torch.zeros(len(captions), width, device=param.device)
        for length, idx in groups.items():
            ids = torch.full((len(idx), length), tok.pad_token_id, dtype=torch.long)
            for j, i in enumerate(idx):
                ids[j, length - len(rows[i]) :] = torch.tensor(rows[i])
            with torch.no_grad():
                hidden = enc(ids.to(param.device), output_hidden_states=True).hidden_states[-2]
            embeds[idx, width - length :] = hidden.float()
            keep[idx, width - length :] = 1
        return {"prompt_embeds": embeds, "prompt_embeds_mask": keep}

    # -- training ----------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32) -> Prepared:
        """Flow-matching inputs; ``extra["lengths"]``: each item's prompt token count.

        The pipeline passes the scheduler's timesteps, sigma * 1000, and steps with the velocity.
        Size conditioning as the pipeline samples: original = target = the image size, crop at (0, 0).
        """
        f = self.flow_draw(latents, generator, objective, t, noise)
        device, (b, _, h, w) = f.x0.device, f.x0.shape
        embeds = text["prompt_embeds"]
        lengths = common.prompt_lengths(embeds, text["prompt_embeds_mask"])
        size = torch.tensor([[h * self.vae_factor, w * self.vae_factor]], device=device, dtype=dtype).repeat(b, 1)
        inputs = {
            "hidden_states": f.noisy.to(dtype),
            "timestep": (f.sigma * 1000).to(dtype),
            "encoder_hidden_states": embeds.to(device=device, dtype=dtype),  # left-padded to the longest
            "original_size": size,
            "target_size": size.clone(),
            "crop_coords": torch.zeros_like(size),
        }
        return self.flow_prepared(f, inputs, mask, objective,
                        extra={"lengths": lengths})

    def predict(self, denoiser: torch.nn.Module, prepared: Prepared) -> torch.Tensor:
        """The transformer's output, each item on its own prompt length (it cannot mask text)."""
        def run(part: dict[str, torch.Tensor], n: int) -> torch.Tensor:
            embeds = part["encoder_hidden_states"]  # right-aligned: the prompt's tokens are the last n
            return denoiser(**{**part, "encoder_hidden_states": embeds[:, embeds.shape[1] - n :]}, return_dict=False)[0]

        return common.forward_by_text_length(run, prepared.inputs, prepared.extra["lengths"])

    def layer_inputs(self, prepared: Prepared) -> tuple[torch.Tensor, ...]:
        """``(noisy, sigma * 1000, prompt_embeds, original_size, target_size, crop_coords)``.

        ``loss`` runs each prompt length as its own forward, which a pipeline (one tensor per
        micro-batch) cannot; here every prompt of the micro-batch must have the same token
        count (always so with ``train.batch_size: 1``).
        """
        n = common.one_prompt_length(self.name, prepared.extra["lengths"])
        i = prepared.inputs
        embeds = i["encoder_hidden_states"]
        return (i["hidden_states"], i["timestep"], embeds[:, embeds.shape[1] - n :], i["original_size"],
                i["target_size"], i["crop_coords"])

    # -- sampling ----------------------------------------------------------------
    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        return {**super().sample_kwargs(cfg), "max_sequence_length": self.max_sequence_length}

    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """Embedding, one layer per block, output (``layers.py``).

        Input tuple ``(noisy, timestep, prompt_embeds, original_size, target_size, crop_coords)``,
        every prompt of the micro-batch at the same length; output ``(prediction,)``.
        """
        return cogview4_layers(common.unwrap(denoiser))
