"""The model-family interface every family implements, and the registry.

A family knows how to build or load its components, encode media and text
for the caches, compute the training loss from cached tensors, and which
stock diffusers pipeline samples and loads its LoRAs. Adding a family is one
new module plus one ``register`` line; nothing else changes.

Tensor conventions (every family):
- pixels: float32 ``[B, 3, F, H, W]`` in [-1, 1] (F = 1 for images);
- latents: ``[B, C, F', h, w]``, already normalised (scaling/shift applied),
  exactly what the denoiser is trained on (``F' = F`` for image VAEs,
  ``(F - 1) / 4 + 1`` for a video VAE with 4x temporal compression);
- text: ``dict[str, Tensor]`` named like the family pipeline's arguments
  (``prompt_embeds``, ``pooled_prompt_embeds``, ...), each ``[B, ...]``.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from diffpipe.config import ModelConfig, ObjectiveConfig, SampleConfig


class Family(ABC):
    """One model family (SD-style UNet, Flux-style transformer, ...)."""

    name: ClassVar[str]
    #: Attribute of the stock pipeline that holds the denoiser, also the LoRA key prefix.
    denoiser_name: ClassVar[str]
    #: PEFT ``target_modules`` used when the config gives none.
    default_lora_targets: ClassVar[list[str]]
    #: Whether the family trains on clips (its pipeline returns ``frames``; samples are MP4s).
    is_video: ClassVar[bool] = False
    #: Frame rate clips are resampled to before planning their frames.
    fps: ClassVar[float] = 24.0
    #: Frame counts ``step * k + offset`` the VAE accepts, as ``(step, offset)``: 4k+1.
    frame_rule: ClassVar[tuple[int, int]] = (4, 1)

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg

    # -- identity: content hashes that go into cache keys ------------------
    #: The diffusers VAE class (what a local folder's ``vae/`` is loaded as).
    vae_class: ClassVar[type]

    def vae_identity(self) -> str:
        """Hash of the VAE's config and weights (latent cache key part).

        Tiny flavor: the built module's tensors (memoised per process); local:
        the ``vae/`` folder's config and weight files.
        """
        from diffpipe.models import _common as common
        from diffpipe.utils import digest

        if self.cfg.flavor == "tiny":
            return common.memo_identity(
                (self.name, self.cfg.seed, "vae"), lambda: digest(common.module_identity(self.load_vae()))
            )
        return digest(common.diffusers_folder_identity(self.vae_class, self.cfg.path, "vae"))

    @abstractmethod
    def text_identity(self) -> str:
        """Hash of the tokenizers' and text encoders' config and weights."""

    # -- geometry ----------------------------------------------------------
    @property
    @abstractmethod
    def pixel_multiple(self) -> int:
        """Image sides must be multiples of this (VAE factor x patch size)."""

    # -- components --------------------------------------------------------
    @abstractmethod
    def load_vae(self) -> torch.nn.Module: ...

    @abstractmethod
    def load_text_encoders(self) -> Any:
        """Opaque bundle of tokenizers + encoders passed back to ``encode_text``."""

    @abstractmethod
    def load_denoiser(self) -> torch.nn.Module: ...

    @abstractmethod
    def load_pipeline(self) -> Any:
        """The family's stock diffusers pipeline with every component, on CPU, eval mode."""

    @property
    @abstractmethod
    def pipeline_class(self) -> type:
        """The diffusers pipeline class (its ``save_lora_weights`` writes our export)."""

    # -- encoding for the caches -------------------------------------------
    @abstractmethod
    def encode_pixels(self, vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        """``[B,3,F,H,W]`` in [-1,1] -> normalised latents ``[B,C,F,h,w]`` (float32)."""

    @abstractmethod
    def encode_text(self, encoders: Any, captions: list[str]) -> dict[str, torch.Tensor]:
        """Captions -> embeddings dict (float32), named like the pipeline's arguments."""

    def load_tokenizers(self) -> Any:
        """What ``token_limits`` and ``count_tokens`` need, ideally the tokenizers alone.

        Validation counts caption tokens with it. The default loads the whole
        text-encoder bundle; families override it to skip the encoder weights.
        """
        return self.load_text_encoders()

    @abstractmethod
    def token_limits(self, encoders: Any) -> dict[str, int]:
        """Max tokens per text encoder, e.g. ``{"clip": 77}``."""

    @abstractmethod
    def count_tokens(self, encoders: Any, captions: list[str]) -> dict[str, list[int]]:
        """Token count of each caption per encoder, with the real tokenizers."""

    # -- training ----------------------------------------------------------
    @abstractmethod
    def loss(
        self,
        denoiser: torch.nn.Module,
        latents: torch.Tensor,
        text: dict[str, torch.Tensor],
        generator: torch.Generator,
        *,
        t: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
        objective: ObjectiveConfig | None = None,
    ) -> torch.Tensor:
        """Per-sample training loss ``[B]`` (float32).

        ``objective`` (``train.objective``) picks the timestep sampling, limits,
        loss and weighting; None = the family's defaults with MSE.

        ``t`` (fractions in (0, 1), one per sample) and ``noise`` fix the
        timestep and noise, for evaluation at fixed quantiles; otherwise both
        are drawn from ``generator``. Inputs are cast to the denoiser's dtype.
        """

    # -- sampling ----------------------------------------------------------
    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        """Keyword arguments for the stock pipeline's ``__call__``."""
        return {
            "num_inference_steps": cfg.steps,
            "guidance_scale": cfg.guidance_scale,
            "height": cfg.height,
            "width": cfg.width,
        }

    def lora_targets(self, configured: list[str] | None) -> list[str]:
        return list(configured) if configured else list(self.default_lora_targets)

    # -- pipeline parallelism (train.pipeline_stages > 1) ---------------------------
    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """The denoiser as layers passing tuples of tensors: embedding, one per block, output."""
        raise ValueError(f"model family {self.name!r} has no pipeline layer list yet; set train.pipeline_stages: 1")

    def pipeline_inputs(
        self,
        latents: torch.Tensor,
        text: dict[str, torch.Tensor],
        generator: torch.Generator,
        objective: ObjectiveConfig | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, torch.Tensor]]:
        """``(first-layer inputs, (target, per-sample weights))``, drawing what ``loss`` draws."""
        raise ValueError(
            f"model family {self.name!r} cannot train pipeline parallel yet (no pipeline_inputs); "
            "set train.pipeline_stages: 1"
        )


_REGISTRY: dict[str, type[Family]] = {}


def register(cls: type[Family]) -> type[Family]:
    """Class decorator: make a family available by its ``name``."""
    _REGISTRY[cls.name] = cls
    return cls


def family_names() -> list[str]:
    from diffpipe.models._load_all import FAMILY_MODULES

    return sorted(FAMILY_MODULES)


def get_family(cfg: ModelConfig) -> Family:
    """The family instance for a model config; a clear error for an unknown name."""
    from diffpipe.models._load_all import FAMILY_MODULES

    if cfg.family not in FAMILY_MODULES:
        raise ValueError(f"model.family: unknown family {cfg.family!r}; known: {', '.join(family_names())}")
    if cfg.family not in _REGISTRY:
        importlib.import_module(FAMILY_MODULES[cfg.family])  # its @register line adds it
    return _REGISTRY[cfg.family](cfg)
