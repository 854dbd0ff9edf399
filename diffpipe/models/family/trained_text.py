"""Text encoders trained beside the denoiser (``train.text_encoder``): their captions are cached as token
ids and encoded at each step by the encoders the training module holds."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Self

import torch

from diffpipe.models import _common as common


def ids_name(encoder: str) -> str:
    """The text cache column of a trained encoder's token ids: ``text_encoder`` -> ``input_ids``,
    ``text_encoder_2`` -> ``input_ids_2``."""
    return "input_ids" + encoder.removeprefix("text_encoder")


class TrainedText:
    """Which text encoders a run trains (a part of :class:`~diffpipe.models.base.Family`)."""

    #: The text encoders (pipeline names) a LoRA may train, each with the prefix of its LoRA's layer names
    #: in kohya and ComfyUI files (``lora_te``); empty: the family caches every embedding.
    trainable_text_encoders: ClassVar[dict[str, str]] = {}
    #: The encoders this run trains (:meth:`with_trained_text`): ``encode_text`` gives their token ids.
    trained_text: tuple[str, ...] = ()

    def with_trained_text(self, names: list[str] | tuple[str, ...]) -> Self:
        """This family with ``names`` (``train.text_encoder.encoders``) trained: their captions are
        cached as token ids (:meth:`encode_text`) and encoded at each step (:meth:`text_from_ids`)."""
        unknown = [n for n in names if n not in self.trainable_text_encoders]
        if unknown:
            can = ", ".join(self.trainable_text_encoders) or "none (every embedding is cached)"
            raise ValueError(f"train.text_encoder.encoders {unknown}: family {self.name!r} trains text encoders: "
                             f"{can}")
        self.trained_text = tuple(names)
        return self

    def embed_ids(self, encoders: Mapping[str, torch.nn.Module], text: dict[str, torch.Tensor]
                  ) -> dict[str, torch.Tensor]:
        """The cached ``text`` (token ids of the trained ``encoders``, embeddings of the others) as
        :meth:`encode_text` returns it without trained encoders, computed with gradients."""
        raise NotImplementedError(f"model family {self.name!r} trains no text encoder")

    def text_from_ids(self, denoiser: torch.nn.Module | None, text: dict[str, torch.Tensor]
                      ) -> dict[str, torch.Tensor]:
        """``text`` for :meth:`prepare`: unchanged, or, when encoders are trained, encoded by the ones
        the training module holds (:class:`diffpipe.training.text_encoders.WithTextEncoders`)."""
        if not self.trained_text:
            return text
        encoders = getattr(common.unwrap(denoiser), "text_encoders", None)
        if encoders is None:
            raise ValueError(f"train.text_encoder.encoders {list(self.trained_text)}: the model holds no "
                             "trained text encoder")
        missing = [k for k in self.id_names() if k not in text]
        if missing:
            raise ValueError(f"train.text_encoder.encoders {list(self.trained_text)}: the text cache holds no "
                             f"token ids ({missing}); rerun `diffpipe plan` and `diffpipe cache` (`diffpipe run` does)")
        return self.embed_ids(encoders, text)

    def id_names(self) -> list[str]:
        """The text cache columns holding the trained encoders' token ids."""
        return [ids_name(n) for n in self.trained_text]
