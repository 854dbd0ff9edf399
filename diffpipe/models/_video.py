"""Helpers the text-to-video families share: timestep and noise draws, T5 text bundles.

``ltxvideo``, ``cogvideox`` and ``mochi`` all condition on one T5 encoder
(sequence output, optionally with its padding mask); ``hunyuanvideo`` uses
the draws only. Draw order is fixed (t, then noise) so a seeded generator
replays a run (the families' ``prepare`` draws here, for the loss and the pipeline alike).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers import T5Config, T5EncoderModel, T5TokenizerFast

from diffpipe.config import ObjectiveConfig
from diffpipe.models import _common as common
from diffpipe.models._draws import draw_t
from diffpipe.models.tokenizers import t5_tokenizer, tokenizer_fingerprint
from diffpipe.training import objectives as obj
from diffpipe.utils import digest

TINY_T5 = {"d_model": 32, "d_kv": 8, "d_ff": 37, "num_layers": 2, "num_heads": 4, "relative_attention_num_buckets": 8}
TINY_LENGTH = 64  # the demo captions fit (the tiny tokenizer spells most words by characters)


def check_video_latents(latents: torch.Tensor, family: str) -> torch.Tensor:
    """The latents as float32 ``[B,C,F,h,w]``; a clear error otherwise."""
    if latents.ndim != 5:
        raise ValueError(f"family {family!r} trains on [B,C,F,h,w] latents, got {tuple(latents.shape)}")
    return latents.float()


def draw(
    o: ObjectiveConfig,
    x0: torch.Tensor,
    generator: torch.Generator,
    t: torch.Tensor | None,
    noise: torch.Tensor | None,
    *,
    default: str = "logit_normal",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t, noise)`` on ``x0``'s device: given ones kept, missing ones drawn from ``generator``.

    ``default``: the sampling used when ``objective.timestep_sampling`` is unset
    (logit-normal for flow models, uniform for DDPM-style ones).
    """
    if t is None:
        t = draw_t(o, x0.shape[0], generator, default=default)
    if noise is None:
        noise = torch.randn(x0.shape, generator=generator, device=generator.device)
        if o.offset_noise:
            noise = obj.add_offset_noise(noise, o.offset_noise, generator)
    elif noise.ndim == x0.ndim - 1:  # an image's noise without its frame axis
        noise = noise[:, :, None]
    return t.to(x0.device).float(), noise.to(x0.device).float()


# -- one T5 encoder -------------------------------------------------------------
@dataclass
class T5Text:
    """A T5 tokenizer and encoder (None while only counting tokens) and the prompt length."""

    tokenizer: T5TokenizerFast
    text_encoder: T5EncoderModel | None
    max_sequence_length: int

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> T5Text:
        self.text_encoder.to(device=device, dtype=dtype)
        return self


def t5_tokenizers(flavor: str, path: str | None, max_length: int, tiny_length: int = TINY_LENGTH) -> T5Text:
    """The tokenizer alone: the tiny flavor's (``tiny_length`` tokens) or a folder's ``tokenizer/``."""
    if flavor == "tiny":
        return T5Text(t5_tokenizer(tiny_length), None, tiny_length)
    tok = T5TokenizerFast.from_pretrained(path, subfolder="tokenizer")
    return T5Text(tok, None, min(int(tok.model_max_length), max_length))


def t5_text(
    flavor: str, path: str | None, max_length: int, seed: int, component: str, tiny_length: int = TINY_LENGTH,
    dtype: torch.dtype = torch.float32, variant: str | None = None,
) -> T5Text:
    """Tokenizer and encoder: random tiny weights from ``seed``, or a folder's ``text_encoder/``."""
    enc = t5_tokenizers(flavor, path, max_length, tiny_length)
    if flavor == "tiny":
        tok = enc.tokenizer
        config = T5Config(
            **TINY_T5,
            vocab_size=len(tok),
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            decoder_start_token_id=tok.pad_token_id,
        )
        with common.seeded(seed, component):
            enc.text_encoder = T5EncoderModel(config).eval()
    else:
        enc.text_encoder = T5EncoderModel.from_pretrained(path, subfolder="text_encoder", dtype=dtype,
                                                          variant=variant).eval()
    return enc


def t5_identity(enc: T5Text) -> str:
    """Identity of an in-memory bundle (tiny flavor)."""
    return digest(
        {
            "tokenizer": tokenizer_fingerprint(enc.tokenizer),
            "text_encoder": common.module_identity(enc.text_encoder),
            "max_sequence_length": enc.max_sequence_length,
        }
    )


def t5_folder_identity(path: str, max_length: int, variant: str | None = None) -> str:
    """Identity of a local folder's ``tokenizer/`` and ``text_encoder/`` without loading the weights."""
    enc = t5_tokenizers("local", path, max_length)
    return digest(
        {
            "tokenizer": tokenizer_fingerprint(enc.tokenizer),
            "text_encoder": common.transformers_folder_identity(T5EncoderModel, T5Config, path, "text_encoder", variant=variant),
            "max_sequence_length": enc.max_sequence_length,
        }
    )


def t5_embeds(enc: T5Text, captions: list[str], *, masked_encoder: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt_embeds, attention_mask)`` as the pipelines' ``_get_t5_prompt_embeds`` compute them.

    Padded to ``max_sequence_length``; ``masked_encoder``: the encoder is given
    the padding mask (Mochi) rather than attending to the padding (LTX, CogVideoX).
    """
    tok = enc.tokenizer(
        list(captions),
        padding="max_length",
        max_length=enc.max_sequence_length,
        truncation=True,
        add_special_tokens=True,
        return_tensors="pt",
    )
    device = next(enc.text_encoder.parameters()).device
    ids, mask = tok.input_ids.to(device), tok.attention_mask.to(device)
    with torch.no_grad():
        embeds = enc.text_encoder(ids, attention_mask=mask.bool() if masked_encoder else None)[0]
    return embeds.float(), mask.float()


def t5_count(enc: T5Text, captions: list[str]) -> dict[str, list[int]]:
    return {"t5": [len(x) for x in enc.tokenizer(list(captions)).input_ids]}


class T5TextFamily:
    """The text side of a family with one T5 encoder; put it before ``Family`` in the bases.

    The tiny encoder's weights are seeded from ``model.seed`` and ``<family>.text_encoder``.
    """

    #: The pipeline's ``max_sequence_length``.
    t5_max_length: ClassVar[int]
    #: Prompt length of the tiny flavor.
    t5_tiny_length: ClassVar[int] = TINY_LENGTH

    def load_tokenizers(self) -> T5Text:
        return t5_tokenizers(self.cfg.flavor, self.cfg.path, self.t5_max_length, self.t5_tiny_length)

    def load_text_encoders(self) -> T5Text:
        return t5_text(self.cfg.flavor, self.cfg.path, self.t5_max_length, self.cfg.seed,
                       f"{self.name}.text_encoder", self.t5_tiny_length, dtype=common.load_dtype(self.cfg, "text_encoder"),
                       variant=self.cfg.weight_variant)

    def encoders_identity(self) -> str:
        if self.cfg.flavor == "tiny":
            return common.memo_identity(
                (self.name, self.cfg.seed, "text"), lambda: t5_identity(self.load_text_encoders())
            )
        return t5_folder_identity(self.cfg.path, self.t5_max_length, variant=self.cfg.weight_variant)

    def token_limits(self, encoders: T5Text) -> dict[str, int]:
        return {"t5": encoders.max_sequence_length}

    def inference_scheduler(self):
        """The scheduler the pipeline samples with: flow matching from the family's scheduler config."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler.from_config(self._scheduler_config)

    def load_pipeline(self):
        """The stock pipeline (``pipeline_class``) from the T5 text side, VAE, transformer and scheduler."""
        enc = self.load_text_encoders()
        return self.pipeline_class(
            tokenizer=enc.tokenizer,
            text_encoder=enc.text_encoder,
            vae=self.load_vae(),
            transformer=self.load_denoiser(),
            scheduler=self.inference_scheduler(),
        )

    def count_tokens(self, encoders: T5Text, captions: list[str]) -> dict[str, list[int]]:
        return t5_count(encoders, captions)
