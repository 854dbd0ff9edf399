"""Helpers the text-to-video families share: timestep and noise draws, T5 text bundles.

``ltxvideo``, ``cogvideox`` and ``mochi`` all condition on one T5 encoder
(sequence output, optionally with its padding mask); ``hunyuanvideo`` uses
the draws only. Draw order is fixed (t, then noise) so a seeded generator
replays a run (the families' ``prepare`` draws here, for the loss and the pipeline alike).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from transformers import T5Config, T5EncoderModel, T5TokenizerFast

from diffpipe.models import _common as common
from diffpipe.models._draws import draw_image
from diffpipe.models.components import TextBundle, TextEncoder, Tokenizer
from diffpipe.models.tokenizers import t5_tokenizer

TINY_T5 = {"d_model": 32, "d_kv": 8, "d_ff": 37, "num_layers": 2, "num_heads": 4, "relative_attention_num_buckets": 8}
TINY_LENGTH = 64  # the demo captions fit (the tiny tokenizer spells most words by characters)


def check_video_latents(latents: torch.Tensor, family: str) -> torch.Tensor:
    """The latents as float32 ``[B,C,F,h,w]``; a clear error otherwise."""
    if latents.ndim != 5:
        raise ValueError(f"family {family!r} trains on [B,C,F,h,w] latents, got {tuple(latents.shape)}")
    return latents.float()


def require_first_frame(control: torch.Tensor | None, variant: str) -> torch.Tensor:
    """The control latents of an image-to-video variant's items (their first frames); a clear error naming
    the dataset keys when the batch has none."""
    if control is None:
        raise ValueError(f"model.variant {variant} needs a control image per item (its first frame): set "
                         "datasets[].control_path / control_column, or control_from_first_frame: true")
    return control


#: A clip's ``(t, noise)`` (:func:`~diffpipe.models._draws.draw_image`, with ``objective.offset_noise``):
#: ``video.draw(objective, x0, generator, t, noise, default=...)``.
draw = partial(draw_image, family="video", offset_noise=True)


# -- one T5 encoder -------------------------------------------------------------
#: The text bundle of a one-T5 family: tokenizer, encoder (None while only counting tokens) and
#: ``max_sequence_length``.
T5Text = TextBundle



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

    Declares the parts (``tokenizer``, ``text_encoder``; the tiny encoder's weights are seeded from
    ``model.seed`` and ``<family>.text_encoder``); the family declares ``prompt_tokens``.
    """

    @property
    def text_parts(self) -> dict[str, Any]:
        return {
            "tokenizer": Tokenizer(T5TokenizerFast, lambda: t5_tokenizer(self.prompt_tokens[0])),
            "text_encoder": TextEncoder(T5EncoderModel, T5Config,
                                        common.tiny_text_model(T5EncoderModel, T5Config, TINY_T5,
                                                               f"{self.name}.text_encoder", common.T5_IDS)),
        }

    def token_limits(self, encoders: T5Text) -> dict[str, int]:
        return {"t5": encoders.max_sequence_length}

    def inference_scheduler(self):
        """The scheduler the pipeline samples with: flow matching from the family's scheduler config."""
        return FlowMatchEulerDiscreteScheduler.from_config(self._scheduler_config)

    def count_tokens(self, encoders: T5Text, captions: list[str]) -> dict[str, list[int]]:
        return t5_count(encoders, captions)
