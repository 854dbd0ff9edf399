"""The LoRA side of a family: which pipeline parts a run trains, the default targets, and how the
exported diffusers file is written and loads back into the stock pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from diffusers.loaders import QwenImageLoraLoaderMixin

from diffpipe.models.family.records import DenoiserPart


class LoraParts:
    """What a run trains and how its LoRA file loads (a part of :class:`~diffpipe.models.base.Family`)."""

    #: PEFT ``target_modules`` used when the config gives none.
    default_lora_targets: ClassVar[list[str]]
    #: The class whose ``save_lora_weights`` writes the diffusers file when the pipeline has no LoRA loader
    #: (None: the pipeline's own); :meth:`load_lora` then says how the file loads.
    lora_writer: ClassVar[type | None] = None

    @property
    def denoiser_attr(self) -> str:
        """The stock pipeline's attribute (and a local folder's subfolder) holding the trained denoiser.

        ``denoiser_name`` unless a family trains one of several (Wan 2.2 A14B's ``transformer_2``).
        """
        return self.denoiser_name

    @property
    def lora_load_kwargs(self) -> dict[str, Any]:
        """Extra ``load_lora_weights`` arguments that route the exported LoRA into ``denoiser_attr``."""
        return {}

    def load_lora(self, pipe: Any, file: str | Path, **load_kwargs: Any) -> None:
        """Load an exported diffusers-format LoRA into the stock pipeline: its ``load_lora_weights``
        (``load_kwargs``: a part's routing, :attr:`lora_load_kwargs`)."""
        pipe.load_lora_weights(str(file), **load_kwargs)

    @property
    def denoiser_parts(self) -> tuple[DenoiserPart, ...]:
        """The pipeline components one run trains (see :class:`DenoiserPart`): ``denoiser_attr`` alone."""
        return (DenoiserPart(self.denoiser_attr, load_kwargs=self.lora_load_kwargs),)

    def lora_targets(self, configured: list[str] | None) -> list[str]:
        """The PEFT ``target_modules`` of a run: the configured ones, else ``default_lora_targets``."""
        return list(configured) if configured else list(self.default_lora_targets)

    def trained_base(self, denoiser: torch.nn.Module) -> torch.nn.Module:
        """The stock denoiser as the adapter is trained on it: itself, or changed in place by a family
        whose LoRA also reshapes the base (Flux Control widens its input layer)."""
        return denoiser


class TransformerLoRA:
    """Families whose stock pipeline has no LoRA loader (put before the base family in the bases): a
    single-transformer pipeline's mixin writes the diffusers file (the same ``transformer.`` layout, the
    adapter config in the header), and the transformer's own PEFT mixin loads it
    (``spec.loads_through_transformer`` puts that on the model card)."""

    @property
    def lora_writer(self) -> type:
        """A single-transformer pipeline's loader mixin: it writes the ``transformer.`` layout."""
        return QwenImageLoraLoaderMixin

    def load_lora(self, pipe: Any, file: str | Path, **load_kwargs: Any) -> None:
        """``pipe.transformer.load_lora_adapter``: the diffusers file's ``transformer.`` keys (the scale is
        folded into them, so no alphas)."""
        pipe.transformer.load_lora_adapter(str(file), prefix="transformer", **load_kwargs)

