"""Family ``flux2``: FLUX.2 [dev], flow matching, Mistral 3 text, guidance-distilled.

Components and names follow ``Flux2Pipeline``: ``vae`` (FLUX.2's AutoencoderKLFlux2, its latents
patchified 2x2 and normalised by the VAE's batch-norm statistics, as FLUX.2 [klein]), ``text_encoder``
(Mistral3ForConditionalGeneration: each caption as a user turn after the pipeline's system message, in the
tokenizer's chat template, padded to ``max_sequence_length``; the hidden states after layers 10, 20 and 30
stacked along the width, as the pipeline's ``_get_mistral_3_small_prompt_embeds`` computes them, which
this family calls) + ``tokenizer``, ``transformer`` (Flux2Transformer2DModel with its guidance embedding),
``scheduler``. The transformer sees ``sigma``, the distilled guidance (``train_guidance``) and the 4-axis
text and image positions, and predicts the velocity ``noise - x0``.

``model.variant: edit`` trains editing with reference images as FLUX.2 [klein] does (its family module).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, ClassVar

import torch
from diffusers import Flux2Pipeline, Flux2Transformer2DModel
from diffusers.pipelines.flux2.pipeline_flux2 import format_input
from transformers import AutoTokenizer, Mistral3Config, Mistral3ForConditionalGeneration

from diffpipe.families.flux2.flavors import TINY_LENGTH, TINY_TEXT, TINY_TRANSFORMER, TINY_VISION
from diffpipe.families.flux2_klein.family import Flux2KleinFamily
from diffpipe.models.components import Model, TextBundle, TextPart, one_text_encoder
from diffpipe.models.llm_tokenizers import llm_tokenizer

MAX_LENGTH = 512  # Flux2Pipeline's default max_sequence_length
#: The text encoder layers whose hidden states are stacked (the pipeline's ``text_encoder_out_layers``).
TEXT_LAYERS = (10, 20, 30)
#: The tiny tokenizer's chat template: Mistral's turn markers around the system message and the caption.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set text = message['content'] if message['content'] is string else message['content'][0]['text'] %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{{ text }}[/INST]{% endif %}{% endfor %}"
)


def _tiny_tokenizer() -> Any:
    tok = llm_tokenizer(TINY_LENGTH, bos="<s>", eos="</s>", pad="<pad>",
                        extra=("[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]"))
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


class MistralChatTokenizer:
    """The folder's ``tokenizer`` as a transformers tokenizer with its chat template: the tokenizer's own,
    else the processor's (``chat_template.jinja`` or ``chat_template.json`` beside it)."""

    @staticmethod
    def from_pretrained(path: str | Path, subfolder: str = "", **kwargs: Any) -> Any:
        tok = AutoTokenizer.from_pretrained(path, subfolder=subfolder, **kwargs)
        if tok.chat_template is None:
            folder = Path(path) / subfolder
            if (folder / "chat_template.jinja").is_file():
                tok.chat_template = (folder / "chat_template.jinja").read_text()
            elif (folder / "chat_template.json").is_file():
                tok.chat_template = json.loads((folder / "chat_template.json").read_text())["chat_template"]
            else:
                raise ValueError(f"{folder}: the FLUX.2 [dev] tokenizer has no chat template (no chat_template.jinja "
                                 "or chat_template.json); the pipeline formats each caption with it")
        return tok


def chat_prompts(tokenizer: Any, captions: list[str]) -> list[str]:
    """The text ``_get_mistral_3_small_prompt_embeds`` tokenizes: the system message, then the caption."""
    return [tokenizer.apply_chat_template(m, tokenize=False) for m in format_input(prompts=list(captions))]


class Flux2Family(Flux2KleinFamily):
    denoiser_model = Model(Flux2Transformer2DModel, TINY_TRANSFORMER)
    text_parts: ClassVar[dict[str, TextPart]] = one_text_encoder(
        MistralChatTokenizer, _tiny_tokenizer, Mistral3ForConditionalGeneration, Mistral3Config, TINY_TEXT,
        "flux2.text_encoder", vision=TINY_VISION, stream="mistral")
    pipeline_class = Flux2Pipeline
    prompt_embeds_method: ClassVar[str] = "_get_mistral_3_small_prompt_embeds"
    text_layers: ClassVar[tuple[int, ...]] = TEXT_LAYERS
    prompt_tokens = (TINY_LENGTH, MAX_LENGTH)
    #: Distilled guidance fed to the guidance embedding while training (1.0, as for FLUX.1-dev LoRAs).
    train_guidance: ClassVar[float] = 1.0

    # -- encoding --------------------------------------------------------------
    def count_tokens(self, encoders: TextBundle, captions: list[str]) -> dict[str, list[int]]:
        prompts = chat_prompts(encoders.tokenizer, captions)
        return {"mistral": [len(ids) for ids in encoders.tokenizer(prompts, add_special_tokens=False).input_ids]}

    # -- training ----------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32, control: torch.Tensor | None = None):
        """FLUX.2 [klein]'s inputs (with the references of ``variant: edit``) and the distilled guidance after
        ``sigma`` (the pipeline passes it in float32; the transformer scales it by 1000 as the timestep)."""
        p = super().prepare(latents, text, generator, objective=objective, t=t, noise=noise, mask=mask, dtype=dtype,
                            control=control)
        items = list(p.inputs.items())
        hidden = items[0][1]
        guidance = torch.full((hidden.shape[0],), self.train_guidance, device=hidden.device, dtype=torch.float32)
        return dataclasses.replace(p, inputs=dict([*items[:2], ("guidance", guidance), *items[2:]]))
