"""Family ``flux2``: FLUX.2 [dev], flow matching, Mistral 3 text, guidance-distilled.

Components and names follow ``Flux2Pipeline``: ``vae`` (FLUX.2's AutoencoderKLFlux2, its latents
patchified 2x2 and normalised by the VAE's batch-norm statistics, as FLUX.2 [klein]), ``text_encoder``
(Mistral3ForConditionalGeneration: each caption as a user turn after the pipeline's system message, in the
tokenizer's chat template, padded to ``max_sequence_length``; the hidden states after layers 10, 20 and 30
stacked along the width, as the pipeline's ``_get_mistral_3_small_prompt_embeds`` computes them, which
this family calls) + ``tokenizer``, ``transformer`` (Flux2Transformer2DModel with its guidance embedding),
``scheduler``. The transformer sees ``sigma``, the distilled guidance (``train_guidance``) and the 4-axis
text and image positions, and predicts the velocity ``noise - x0``.

``model.variant: edit`` trains editing with reference images (the same checkpoint and pipeline, its
``image`` argument): each item's control images (``datasets[].control_path``, a list for several) are
cached as latents like the target's, packed into tokens and appended after the target's, with the
positions ``Flux2Pipeline.prepare_image_latents`` gives them (time axis 10, 20, ... per reference); the
transformer's output for them is dropped, so the loss covers the target. The pipeline resizes a
reference above 1024x1024 pixels to that area; the cache keeps it at the target's size (the same for a
target up to 1024x1024).

The stock pipeline holds a ``PixtralProcessor`` as its tokenizer, which transformers builds only with
torchvision (not installed: its wheels for torch 2.13 need the CUDA build). For text the processor only
renders the chat template and calls its tokenizer, so the family loads the folder's tokenizer itself
(:class:`MistralChatTokenizer`) and hands it to the pipeline.
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

from diffpipe.config import MAX_REFERENCES
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


def reference_tokens(control: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference latents ``[B, C, R, h, w]`` (cached like the target: patchified, normalised) -> their packed
    tokens one after the other ``[B, R*h*w, C]`` and positions ``[B, R*h*w, 4]``, as
    ``Flux2Pipeline.prepare_image_latents`` builds them from its list of images."""
    refs = [control[:, :, k] for k in range(control.shape[2])]
    ids = Flux2Pipeline._prepare_image_ids([r[:1] for r in refs]).to(control.device)
    tokens = torch.cat([Flux2Pipeline._pack_latents(r) for r in refs], dim=1)
    return tokens, ids.expand(control.shape[0], -1, -1)


class Flux2Family(Flux2KleinFamily):
    name = "flux2"
    variants: ClassVar[tuple[str, ...]] = ("edit",)
    token_streams: ClassVar[dict[str, tuple[str, str]]] = {"mistral": ("tokenizer", "sequence")}
    denoiser_model = Model(Flux2Transformer2DModel, TINY_TRANSFORMER)
    text_parts: ClassVar[dict[str, TextPart]] = one_text_encoder(
        MistralChatTokenizer, _tiny_tokenizer, Mistral3ForConditionalGeneration, Mistral3Config, TINY_TEXT,
        "flux2.text_encoder", vision=TINY_VISION)
    pipeline_class = Flux2Pipeline
    prompt_embeds_method: ClassVar[str] = "_get_mistral_3_small_prompt_embeds"
    text_layers: ClassVar[tuple[int, ...]] = TEXT_LAYERS
    prompt_tokens = (TINY_LENGTH, MAX_LENGTH)
    #: Distilled guidance fed to the guidance embedding while training (1.0, as for FLUX.1-dev LoRAs).
    train_guidance: ClassVar[float] = 1.0

    def __init__(self, cfg):
        super().__init__(cfg)
        #: ``variant: edit`` trains with reference images (instance attributes: one variant).
        self.variant = cfg.variant
        self.uses_control = self.variant == "edit"
        self.max_references = MAX_REFERENCES if self.uses_control else 1  # the datasets' limit

    # -- encoding --------------------------------------------------------------
    def count_tokens(self, encoders: TextBundle, captions: list[str]) -> dict[str, list[int]]:
        prompts = chat_prompts(encoders.tokenizer, captions)
        return {"mistral": [len(ids) for ids in encoders.tokenizer(prompts, add_special_tokens=False).input_ids]}

    # -- training ----------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32, control: torch.Tensor | None = None):
        """FLUX.2 [klein]'s inputs with the distilled guidance after ``sigma`` (the pipeline passes it in
        float32; the transformer scales it by 1000 as the timestep); under ``variant: edit`` the references'
        tokens and positions in ``extra["reference"]``."""
        p = super().prepare(latents, text, generator, objective=objective, t=t, noise=noise, mask=mask, dtype=dtype)
        items = list(p.inputs.items())
        hidden = items[0][1]
        guidance = torch.full((hidden.shape[0],), self.train_guidance, device=hidden.device, dtype=torch.float32)
        p = dataclasses.replace(p, inputs=dict([*items[:2], ("guidance", guidance), *items[2:]]))
        if self.uses_control:  # ``variant: edit``: the references' tokens, appended in ``predict``
            p.extra["reference"] = reference_tokens(self.reference_image(control, latents))
        return p

    def encode_control(self, vae: torch.nn.Module, control: torch.Tensor, *, frames: int) -> dict[str, torch.Tensor]:
        """References ``[B, 3, R, H, W]`` (one per frame) each encoded as an image -> ``[B, C, R, h, w]``."""
        return {"control": torch.cat([self.encode_pixels(vae, control[:, :, k : k + 1])
                                      for k in range(control.shape[2])], dim=2)}

    def reference_image(self, control: torch.Tensor | None, latents: torch.Tensor) -> torch.Tensor:
        """The reference latents ``[B, C, R, h, w]`` on the latents' device (one reference: ``R = 1``)."""
        if control is not None and control.ndim == 5 and 1 <= control.shape[2] <= self.max_references:
            return control.to(latents.device).float()
        return super().reference_image(control, latents)[:, :, None]

    def predict(self, denoiser: torch.nn.Module, prepared):
        """The forward with the references' tokens after the target's (``variant: edit``); the target's output."""
        if "reference" not in prepared.extra:
            return super().predict(denoiser, prepared)
        tokens, ids = prepared.extra["reference"]
        x, img_ids = prepared.inputs["hidden_states"], prepared.inputs["img_ids"]
        inputs = {**prepared.inputs, "hidden_states": torch.cat([x, tokens.to(x)], dim=1),
                  "img_ids": torch.cat([img_ids, ids.to(img_ids)], dim=1)}
        return super().predict(denoiser, dataclasses.replace(prepared, inputs=inputs))[:, : x.shape[1]]

    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        if self.uses_control:
            raise ValueError("flux2 variant edit: pipeline parallelism is not implemented (the layers would carry "
                             "the reference tokens); set train.pipeline_stages: 1")
        return super().pipeline_layers(denoiser)
