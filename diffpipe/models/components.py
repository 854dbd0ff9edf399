"""Declared components: what a family is built from, so that building and loading are written once.

A family declares its diffusers models (:class:`Model`: the VAE and the denoiser) and its text side
(:class:`Tokenizer` and :class:`TextEncoder` parts, named like the stock pipeline's arguments:
``tokenizer``, ``text_encoder_2``, ...). :class:`~diffpipe.models.base.Family` then builds them for the
tiny flavor (the declared tiny config, weights seeded from ``model.seed``), loads them from a local
folder or a single file in the configured dtype (``diffpipe.models._common``: the one place dtypes
are applied at load), fingerprints them for the cache keys, and assembles the stock pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from diffpipe.models._common import LM_IDS, tiny_clip_text_encoder, tiny_text_model
from diffpipe.models.tokenizers import clip_tokenizer


@dataclass(frozen=True)
class Model:
    """A diffusers model of the family (``AutoencoderKL``, ``FluxTransformer2DModel``, ...)."""

    cls: type
    #: The tiny flavor's config (``cls(**tiny)``).
    tiny: Mapping[str, Any]
    #: The tiny weights are seeded from ``model.seed`` and ``<seed>.<subfolder>``; "" = the family's name.
    seed: str = ""


@dataclass(frozen=True)
class Models:
    """A family's VAE, denoiser, scheduler and pipeline classes, in one declaration.

    Their tiny configs are the folder's ``flavors.py`` names every family shares: ``TINY_VAE``,
    ``TINY_TRANSFORMER`` and ``TINY_SCHEDULER``. :class:`~diffpipe.models.base.Family` turns a class's
    ``models`` into its ``vae_model``, ``denoiser_model``, ``scheduler_model`` and ``pipeline_class``; a
    None class is not declared (the family builds that part otherwise, or inherits it).
    """

    vae: type | None
    denoiser: type | None
    scheduler: type | None
    pipeline: type | None
    flavors: ModuleType
    #: As :attr:`Model.seed`.
    seed: str = ""

    #: Class attribute of the family -> (this declaration's field, the flavors' tiny config name).
    DECLARES = {"vae_model": ("vae", "TINY_VAE"), "denoiser_model": ("denoiser", "TINY_TRANSFORMER"),
                "scheduler_model": ("scheduler", "TINY_SCHEDULER")}

    def declared(self) -> dict[str, Any]:
        """The family class attributes this declares."""
        out: dict[str, Any] = {attr: Model(getattr(self, part), getattr(self.flavors, tiny), self.seed)
                               for attr, (part, tiny) in self.DECLARES.items() if getattr(self, part) is not None}
        if self.pipeline is not None:
            out["pipeline_class"] = self.pipeline
        return out


@dataclass(frozen=True)
class Tokenizer:
    """A tokenizer: ``cls.from_pretrained(path, subfolder=<its name>)``, or ``tiny()`` for the tiny flavor."""

    cls: type
    tiny: Callable[[], Any]
    #: The dataset checks' name for its token stream (``"gemma"``: "gemma: 320 tokens > 300"); "" = not
    #: checked through this tokenizer. ``Family.token_streams`` is derived from it.
    stream: str = ""
    #: The stream's limit: ``"sequence"`` (the configured ``max_sequence_length``) or ``"tokenizer"`` (its
    #: ``model_max_length``).
    limit: str = "sequence"


@dataclass(frozen=True)
class TextEncoder:
    """A transformers text encoder, loaded in ``model.text_encoder_dtype`` from the subfolder of its name.

    ``tiny(tokenizer, seed)`` builds the tiny one from its tokenizer (vocabulary size, special ids) and
    ``model.seed``; ``config_cls`` reads a local folder's config for the cache key without the weights.
    """

    cls: type
    config_cls: type
    tiny: Callable[[Any, int], torch.nn.Module]
    #: The part name of the tokenizer it reads; "" = its own name with ``text_encoder`` as ``tokenizer``
    #: (``text_encoder_2`` reads ``tokenizer_2``).
    tokenizer: str = ""


TextPart = Tokenizer | TextEncoder


def one_text_encoder(tokenizer_cls: type, tiny_tokenizer: Callable[[], Any], model_cls: type, config_cls: type,
                     tiny_config: Mapping[str, Any], seed: str, ids: tuple[str, ...] = LM_IDS,
                     vision: Mapping[str, Any] | None = None, stream: str = "") -> dict[str, TextPart]:
    """The ``text_parts`` of a family with one tokenizer and one text encoder (``tokenizer``, ``text_encoder``):
    the tiny encoder is ``model_cls(config_cls(**tiny_config))`` sized by the tiny tokenizer, seeded from
    ``model.seed`` and ``seed`` (``diffpipe.models._common.tiny_text_model``; ``vision``: a vision-language
    model's vision tower config beside ``tiny_config`` as its text config; ``stream``: the tokenizer's
    :attr:`Tokenizer.stream`, limited by ``max_sequence_length``)."""
    return {
        "tokenizer": Tokenizer(tokenizer_cls, tiny_tokenizer, stream),
        "text_encoder": TextEncoder(model_cls, config_cls, tiny_text_model(model_cls, config_cls, tiny_config,
                                                                           seed, ids, vision=vision)),
    }


def clip_text_encoder(seed: str, part: str = "text_encoder_2", cls: type | None = None,
                      stream: str = "") -> dict[str, TextPart]:
    """A CLIP tokenizer and text encoder as the text parts ``part`` and its tokenizer (``text_encoder_2``:
    ``tokenizer_2``); ``cls`` ``CLIPTextModel`` (default) or ``CLIPTextModelWithProjection``; the tiny encoder
    is seeded from ``model.seed`` and ``seed``; ``stream``: the tokenizer's :attr:`Tokenizer.stream`, limited
    by its ``model_max_length`` (77)."""
    cls = cls or CLIPTextModel
    return {
        part.replace("text_encoder", "tokenizer"): Tokenizer(CLIPTokenizer, clip_tokenizer, stream, "tokenizer"),
        part: TextEncoder(cls, CLIPTextConfig, lambda tok, s: tiny_clip_text_encoder(tok, s, seed, cls=cls)),
    }


class TextBundle:
    """A family's tokenizers and text encoders by part name, plus its text settings (``max_sequence_length``).

    Attribute access reads both (``bundle.tokenizer_2``, ``bundle.max_sequence_length``); encoders are
    None when only the tokenizers were loaded (:meth:`Family.load_tokenizers`, enough to count tokens).
    """

    def __init__(self, parts: Mapping[str, Any], **settings: Any):
        self.__dict__["parts"] = dict(parts)
        self.__dict__["settings"] = settings

    def __getattr__(self, name: str) -> Any:
        parts, settings = self.__dict__["parts"], self.__dict__["settings"]
        if name in parts:
            return parts[name]
        if name in settings:
            return settings[name]
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        (self.parts if name in self.parts else self.settings)[name] = value

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> TextBundle:
        """Move the encoders (tokenizers stay); returns the bundle."""
        for part in self.parts.values():
            if isinstance(part, torch.nn.Module):
                part.to(device=device, dtype=dtype)
        return self
