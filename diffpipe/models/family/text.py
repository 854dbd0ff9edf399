"""Text encoding for the caches: the declared tokenizers and text encoders, the prompt length the caches
keep, the token streams the dataset checks count, and the stock pipeline's own prompt encoding."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar, Self

import torch

from diffpipe.models import _common as common
from diffpipe.models.casting import enable_fp8_text_encoder
from diffpipe.models.components import TextBundle, Tokenizer


def derive_token_streams(cls: type) -> None:
    """A family class's ``token_streams`` from its declared tokenizers' streams, unless it spells them out."""
    parts = cls.__dict__.get("text_parts")
    if isinstance(parts, dict) and "token_streams" not in cls.__dict__:
        streams = {part.stream: (name, part.limit) for name, part in parts.items()
                   if isinstance(part, Tokenizer) and part.stream}
        if streams:
            cls.token_streams = streams


class TextEncoding(ABC):
    """Tokenizers, text encoders and captions to embeddings (a part of :class:`~diffpipe.models.base.Family`)."""

    #: The tokenizers and text encoders by the pipeline's argument names, in the order their identities
    #: enter the text cache key.
    text_parts: ClassVar[dict[str, Any]] = {}
    #: Per text encoder, as the dataset checks name it: ``(tokenizer attribute, limit)``, where the limit
    #: is ``"sequence"`` (the configured ``max_sequence_length``) or ``"tokenizer"`` (its
    #: ``model_max_length``). A family with other rules overrides ``token_limits``/``count_tokens``.
    token_streams: ClassVar[dict[str, tuple[str, str]]] = {}
    #: Prompt tokens the text caches keep, as ``(tiny flavor, pipeline's max_sequence_length)``; a local
    #: folder's ``prompt_tokenizer`` lowers the second when its ``model_max_length`` (less ``prompt_drop``
    #: template tokens) is lower. None: the family keeps no fixed prompt length.
    prompt_tokens: ClassVar[tuple[int, int] | None] = None
    prompt_tokenizer: ClassVar[str] = "tokenizer"
    prompt_drop: ClassVar[int] = 0
    #: Base LoRAs' text-encoder parts (:meth:`with_base_text`): encoder name -> what folds them in.
    base_text: Mapping[str, Any] = {}
    #: Their part of the text cache key ("" without any).
    base_text_identity: str = ""

    def with_base_text(self, folds: Mapping[str, Any], identity: str) -> Self:
        """This family with ``model.base_loras``' text-encoder parts folded into every encoder it loads.

        ``folds``: encoder name -> an object whose ``fold_all(module)`` adds the base LoRAs' updates to the
        encoder's weights (:class:`diffpipe.training.base_loras.BaseDeltas`, built by the layers above, which
        read the LoRA files); ``identity``: their content digests and scales, joined to the text cache key
        (:meth:`text_identity`), so a change of base LoRA recaches the captions."""
        self.base_text, self.base_text_identity = dict(folds), identity
        return self

    @cached_property
    def max_sequence_length(self) -> int:
        """Prompt tokens the caches keep and sampling uses: ``prompt_tokens``' tiny length for the tiny flavor;
        else the pipeline's length, or the folder tokenizer's ``model_max_length`` (less ``prompt_drop``
        template tokens) when that is lower."""
        if self.prompt_tokens is None:
            raise AttributeError(f"{self.name} keeps no fixed prompt length")
        tiny, cap = self.prompt_tokens
        if self.cfg.flavor == "tiny":
            return tiny
        config = Path(self.cfg.path) / self.prompt_tokenizer / "tokenizer_config.json"
        limit = json.loads(config.read_text()).get("model_max_length") if config.is_file() else None
        return cap if limit is None else min(int(limit) - self.prompt_drop, cap)

    def text_settings(self) -> dict[str, Any]:
        """Text settings carried in the bundle and the text cache key (``max_sequence_length``, ...)."""
        return {} if self.prompt_tokens is None else {"max_sequence_length": self.max_sequence_length}

    def _text_bundle(self, *, encoders: bool, only: Collection[str] | None = None, base: bool = True) -> Any:
        """``base``: fold the base LoRAs' text parts in (:meth:`with_base_text`); the encoders' identity
        reads them without (the base LoRAs enter the cache key by their own digest)."""
        parts, out = self._declared("text_parts"), {}
        tiny = self.cfg.flavor == "tiny"
        for name, part in parts.items():
            if isinstance(part, Tokenizer):
                out[name] = self.load_tokenizer(name)
            elif not encoders or (only is not None and name not in only):
                out[name] = None
            elif tiny:
                out[name] = part.tiny(out[part.tokenizer or name.replace("text_encoder", "tokenizer")], self.cfg.seed)
            else:
                out[name] = common.pretrained_text_encoder(part.cls, self.cfg, name)
        if base:
            for name, folds in self.base_text.items():
                if out.get(name) is not None:  # before fp8 storage (stored_text): the fold is in the weights' dtype
                    folds.fold_all(out[name])
        return self.stored_text(TextBundle(out, **self.text_settings()))

    def stored_text(self, bundle: Any) -> Any:
        """The bundle with its encoders stored as ``model.text_encoder_weights`` says (fp8: float8 weights,
        computed in ``model.text_encoder_dtype``); every loader of text encoders returns through it."""
        if self.cfg.text_encoder_weights == "fp8":
            compute = common.load_dtype(self.cfg, "text_encoder")
            parts = bundle.parts if hasattr(bundle, "parts") else vars(bundle)  # a family's own bundle class
            for part in parts.values():
                if isinstance(part, torch.nn.Module):
                    enable_fp8_text_encoder(part, compute)
        return bundle

    def load_tokenizer(self, name: str = "tokenizer") -> Any:
        """One declared tokenizer: the tiny flavor's, or the folder's subfolder ``name`` (no text settings:
        ``text_settings`` may measure a template with it)."""
        part = self._declared("text_parts")[name]
        return part.tiny() if self.cfg.flavor == "tiny" else part.cls.from_pretrained(self.cfg.path, subfolder=name)

    def load_tokenizers(self) -> Any:
        """What ``token_limits`` and ``count_tokens`` need: the declared tokenizers, no encoder weights."""
        return self._text_bundle(encoders=False)

    def load_text_encoders(self, only: Collection[str] | None = None) -> Any:
        """The declared tokenizers and text encoders (a :class:`~diffpipe.models.components.TextBundle`),
        passed back to ``encode_text``; ``only``: load just these encoders (the others are None: training
        a text encoder never loads FLUX.1's T5-XXL)."""
        return self._text_bundle(encoders=True, only=only)

    def text_pipeline(self, encoders: Any) -> Any:
        """The stock pipeline holding only the text components, to encode captions with its own
        ``encode_prompt`` (so the cache equals what sampling computes)."""
        return self.pipeline_class(vae=None, **{self.denoiser_name: None}, scheduler=None, **encoders.parts)

    def pipeline_prompt(self, encoders: Any, captions: list[str]) -> Any:
        """What the stock pipeline's ``encode_prompt`` returns for ``captions`` without guidance, at the
        bundle's ``max_sequence_length``, on the text encoder's device, without gradients."""
        device = next(encoders.text_encoder.parameters()).device
        with torch.no_grad():
            return self.text_pipeline(encoders).encode_prompt(
                list(captions), do_classifier_free_guidance=False, device=device,
                max_sequence_length=encoders.max_sequence_length)

    @abstractmethod
    def encode_text(self, encoders: Any, captions: list[str]) -> dict[str, torch.Tensor]:
        """Captions -> embeddings dict (float32), named like the pipeline's arguments."""

    def caption_prompts(self, captions: list[str]) -> list[str]:
        """The text the pipeline tokenizes for each caption (a family's template or cleaning)."""
        return list(captions)

    def token_limits(self, encoders: Any) -> dict[str, int]:
        """Max tokens per text encoder, e.g. ``{"clip": 77}``."""
        if not self.token_streams:
            raise NotImplementedError(f"{self.name} declares no token_streams and no token_limits")
        return {label: encoders.max_sequence_length if limit == "sequence" else getattr(encoders, tok).model_max_length
                for label, (tok, limit) in self.token_streams.items()}

    def count_tokens(self, encoders: Any, captions: list[str]) -> dict[str, list[int]]:
        """Token count of each caption per encoder, with the real tokenizers."""
        if not self.token_streams:
            raise NotImplementedError(f"{self.name} declares no token_streams and no count_tokens")
        prompts = self.caption_prompts(captions)
        return {label: [len(ids) for ids in getattr(encoders, tok)(prompts).input_ids]
                for label, (tok, _) in self.token_streams.items()}

