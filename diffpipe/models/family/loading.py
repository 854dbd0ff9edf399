"""Building and loading a family's components from their declarations (``diffpipe.models.components``):
the tiny flavor built from the declared configs, a local folder or single files in the configured dtypes,
the scheduler, and the stock pipeline assembled from them."""

from __future__ import annotations

from functools import cached_property
from typing import Any, ClassVar

import torch

from diffpipe.models import _common as common


def derive_components(cls: type) -> None:
    """Fill in what a family class declares at once: its components from ``models``, its ``vae_class``
    from ``vae_model``."""
    if cls.__dict__.get("models") is not None:
        for attr, value in cls.models.declared().items():
            setattr(cls, attr, value)
    if cls.__dict__.get("vae_model") is not None and "vae_class" not in cls.__dict__:
        cls.vae_class = cls.vae_model.cls


class Loading:
    """The declared components and their loaders (a part of :class:`~diffpipe.models.base.Family`)."""

    #: The VAE and the denoiser, declared (class, tiny config); families that build them otherwise override
    #: ``load_vae`` / ``load_denoiser``.
    vae_model: ClassVar[Any] = None
    denoiser_model: ClassVar[Any] = None
    #: The VAE, denoiser, scheduler and pipeline declared at once
    #: (:class:`~diffpipe.models.components.Models`, tiny configs by the flavors' shared names).
    models: ClassVar[Any] = None
    #: The scheduler: its class and tiny config (a local folder's ``scheduler/`` config otherwise).
    scheduler_model: ClassVar[Any] = None
    #: The diffusers pipeline class (its ``save_lora_weights`` writes our export); a family whose pipeline
    #: depends on the model (a variant) makes it a property.
    pipeline_class: ClassVar[type]
    #: Keyword arguments the stock pipeline takes besides its components (``safety_checker=None``, ...).
    pipeline_extras: ClassVar[dict[str, Any]] = {}
    #: The diffusers VAE class (what a local folder's ``vae/`` is loaded as).
    vae_class: ClassVar[type]
    #: Whether the VAE encodes in float32 under ``model.vae_dtype: auto`` on CUDA (16 bits lose
    #: precision or overflow in it: SD 1.x/SDXL's VAE, Wan's causal 3D VAE).
    vae_needs_fp32: ClassVar[bool] = False

    def vae_dtype(self, *, cuda: bool | None = None) -> torch.dtype:
        """The dtype the VAE loads and encodes in (``model.vae_dtype``; ``auto`` minds ``vae_needs_fp32``)."""
        return common.load_dtype(self.cfg, "vae", cuda=cuda, vae_fp32=self.vae_needs_fp32)

    def _declared(self, what: str) -> Any:
        value = getattr(self, what)
        if not value:
            raise NotImplementedError(f"family {self.name!r} declares no {what} and does not override its loader")
        return value

    def _config(self, what: str, subfolder: str) -> dict[str, Any]:
        """A declared component's config: the tiny one, or the local folder's ``subfolder`` config."""
        model = self._declared(what)
        if self.cfg.flavor == "tiny":
            return dict(model.tiny)
        return dict(model.cls.load_config(self.cfg.path, subfolder=subfolder))

    @cached_property
    def _vae_config(self) -> dict[str, Any]:
        return self._config("vae_model", "vae")

    @cached_property
    def _denoiser_config(self) -> dict[str, Any]:
        return self._config("denoiser_model", self.denoiser_name)

    @cached_property
    def _scheduler_config(self) -> dict[str, Any]:
        return self._config("scheduler_model", "scheduler")

    def inference_scheduler(self) -> Any:
        """The scheduler the stock pipeline samples with: the declared one, from the family's config."""
        return self._declared("scheduler_model").cls.from_config(self._scheduler_config)

    def _model(self, model: Any, subfolder: str) -> torch.nn.Module:
        dtype = self.vae_dtype() if subfolder == "vae" else None
        return common.component(model.cls, self.cfg, model.seed or self.name, subfolder, model.tiny, dtype)

    def load_vae(self) -> torch.nn.Module:
        """The declared VAE (``vae_model``), in eval mode, in ``model.vae_dtype``."""
        return self._model(self._declared("vae_model"), "vae")

    def load_denoiser(self) -> torch.nn.Module:
        """The declared denoiser (``denoiser_model``) from the ``denoiser_name`` subfolder, in ``model.dtype``."""
        return self._model(self._declared("denoiser_model"), self.denoiser_name)

    def streamed_denoiser(self) -> tuple[type, str] | None:
        """The diffusers class and subfolder of the denoiser as one model of the local folder, for training to
        read tensor by tensor (``diffpipe.training.load``); None where ``load_denoiser`` builds it its own way
        (a family that overrides it and not this: training then loads it whole)."""
        if type(self).load_denoiser is not Loading.load_denoiser:
            return None
        return self._declared("denoiser_model").cls, self.denoiser_name

    def load_pipeline(self) -> Any:
        """The family's stock diffusers pipeline with every component, on CPU, eval mode."""
        text = self.load_text_encoders()
        return self.pipeline_class(
            vae=self.load_vae(), **{self.denoiser_name: self.load_denoiser()},
            scheduler=self.inference_scheduler(), **text.parts, **self.pipeline_extras,
        )

