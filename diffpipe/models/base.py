"""The model-family interface every family implements: :class:`Family`, composed of named parts.

A family knows how to build or load its components, encode media and text
for the caches, prepare a batch's training inputs from cached tensors (one
path, :meth:`Family.prepare`, for the loss, evaluation and pipeline-parallel
training), and which stock diffusers pipeline samples and loads its LoRAs. Each family lives in its
own folder under ``diffpipe/families/`` (see ``diffpipe.models.spec``).

Each part is a class in ``diffpipe/models/family/``, so a family overrides a small named part:

- :mod:`~diffpipe.models.family.loading`: the declared components, their loaders, the stock pipeline;
- :mod:`~diffpipe.models.family.media`: pixels to latents (``encode_pixels``), the latent geometry;
- :mod:`~diffpipe.models.family.text`: tokenizers, text encoders, ``encode_text``, token streams;
- :mod:`~diffpipe.models.family.trained_text`: text encoders trained beside the denoiser;
- :mod:`~diffpipe.models.family.identity`: the cache keys' content hashes;
- :mod:`~diffpipe.models.family.inputs`: ``prepare``, ``predict``, ``loss`` and the flow draws;
- :mod:`~diffpipe.models.family.parallel`: the pipeline-parallel layers and their inputs;
- :mod:`~diffpipe.models.family.lora`: the trained parts and how the exported LoRA loads;
- :mod:`~diffpipe.models.family.sampling`: the stock pipeline's sampling arguments.

Tensor conventions (every family):
- pixels: float32 ``[B, 3, F, H, W]`` in [-1, 1] (F = 1 for images);
- latents: ``[B, C, F', h, w]``, already normalised (scaling/shift applied),
  exactly what the denoiser is trained on (``F' = F`` for image VAEs,
  ``(F - 1) / 4 + 1`` for a video VAE with 4x temporal compression);
- text: ``dict[str, Tensor]`` named like the family pipeline's arguments
  (``prompt_embeds``, ``pooled_prompt_embeds``, ...), each ``[B, ...]``;
- mask: ``[B, 1, F', h, w]`` loss weights in [0, 1] on the latent grid
  (datasets with ``mask_path``), applied through :meth:`Family.loss_mask`;
- control: ``[B, C, F_c, h, w]`` conditioning latents of each item's control
  image, passed only to families with ``uses_control``.
"""

from __future__ import annotations

from abc import ABC
from typing import TYPE_CHECKING, Any, ClassVar

from diffpipe.config import ModelConfig
from diffpipe.models.family.identity import Identity
from diffpipe.models.family.inputs import ReferenceTokens, TrainingInputs
from diffpipe.models.family.loading import Loading, derive_components
from diffpipe.models.family.lora import LoraParts, TransformerLoRA
from diffpipe.models.family.media import Media
from diffpipe.models.family.parallel import PipelineParallel
from diffpipe.models.family.records import DenoiserPart, FlowDraw, Prepared, split_parts
from diffpipe.models.family.sampling import Sampling
from diffpipe.models.family.text import TextEncoding, derive_token_streams
from diffpipe.models.family.trained_text import TrainedText, ids_name

if TYPE_CHECKING:
    from diffpipe.models.spec import Published

__all__ = [
    "DenoiserPart", "Family", "FlowDraw", "Prepared", "ReferenceTokens", "TransformerLoRA", "ids_name", "split_parts",
]


def _folder_family(module: str) -> str | None:
    """The family a class in a family folder belongs to: the folder's name with ``-`` for ``_``
    (``diffpipe.families.flux_kontext.family`` -> ``flux-kontext``), the rule every registry line follows."""
    parts = module.split(".")
    return parts[2].replace("_", "-") if parts[:2] == ["diffpipe", "families"] and len(parts) > 2 else None


class Family(Loading, Media, TextEncoding, TrainedText, Identity, TrainingInputs, PipelineParallel, LoraParts,
             Sampling, ABC):
    """One model family (SD-style UNet, Flux-style transformer, ...): what it is, checked against a run's
    ``model`` config, and its parts (the bases, one module each under ``diffpipe/models/family/``)."""

    #: The ``model.family`` name; derived from the registry for a class in a family folder's ``family.py``.
    name: ClassVar[str]
    #: Attribute of the stock pipeline that holds the denoiser, also the LoRA key prefix (``unet`` for UNets).
    denoiser_name: ClassVar[str] = "transformer"
    #: Whether the family trains on clips (its pipeline returns ``frames``; samples are MP4s).
    is_video: ClassVar[bool] = False
    #: Frame rate clips are resampled to before planning their frames.
    fps: ClassVar[float] = 24.0
    #: Frame counts ``step * k + offset`` the VAE accepts, as ``(step, offset)``: 4k+1.
    frame_rule: ClassVar[tuple[int, int]] = (4, 1)
    #: Whether ``loss`` takes ``control`` latents (edit / reference-image families).
    uses_control: ClassVar[bool] = False
    #: How many control (reference) images an item may have (``datasets[].control_path`` as a list): they
    #: reach ``loss`` as the frames of ``control``, ``[B, C, R, h, w]``.
    max_references: ClassVar[int] = 1
    #: Whether each control is a first and a last frame (``datasets[].control_from_last_frame``; Wan FLF2V):
    #: the plan then requires that option of every dataset, and refuses it for every other family.
    uses_last_frame: ClassVar[bool] = False
    #: Whether ``model.first_frame_p`` applies: some items given their first frame, the others text only.
    mixes_first_frame: ClassVar[bool] = False
    #: Whether ``loss`` takes ``sizes``: each item's source size and crop (SDXL's add_time_ids).
    uses_sizes: ClassVar[bool] = False
    #: Whether the text encoder also sees each item's control image (an edit model's
    #: vision-language encoder): the plan then keys text by caption and control image, and
    #: the text cache passes the images to ``encode_text(encoders, captions, images=...)``.
    text_uses_control: ClassVar[bool] = False
    #: Versions ``model.variant`` may name (empty: the family has one).
    variants: ClassVar[tuple[str, ...]] = ()
    #: Subfolders besides ``vae`` and ``denoiser_name`` that ``model.single_files`` may replace.
    extra_single_files: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        if cfg.variant is not None and cfg.variant not in self.variants:
            known = ", ".join(self.variants) or "none"
            raise ValueError(f"model.variant {cfg.variant!r}: family {self.name!r} has variants: {known}")
        if cfg.expert is not None and not self.variants:
            raise ValueError(f"model.expert {cfg.expert!r}: family {self.name!r} has no experts")
        if cfg.first_frame_p is not None and not self.mixes_first_frame:
            raise ValueError(f"model.first_frame_p: family {self.name!r} does not mix image- and text-to-video "
                             "items (ltx2 variant i2v does)")
        allowed = ("vae", self.denoiser_name, *self.extra_single_files)
        for key in cfg.single_files:
            if key not in allowed:
                raise ValueError(
                    f"model.single_files.{key}: family {self.name!r} loads only {', '.join(allowed)} from "
                    "single files (tokenizers and text encoders come from the folder at model.path)"
                )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Derives what a family class does not spell out: its ``name`` from its folder's registry line,
        its components from ``models``, its ``token_streams`` from its tokenizers' streams."""
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            cls.name = _folder_family(cls.__module__) or getattr(cls, "name", "")
        derive_components(cls)
        derive_token_streams(cls)

    @property
    def published_variants(self) -> tuple[str | None, ...]:
        """The ``Published.variant`` names whose weights this model is (the family's variant, if it has any)."""
        return (getattr(self, "variant", None),)

    def sizes(self, published: Published) -> bool:
        """Whether a memory estimate can size this model's training with ``published``'s denoiser: it takes
        this variant's inputs (a published model of no particular variant, or of this one)."""
        return published.variant is None or published.variant in self.published_variants

