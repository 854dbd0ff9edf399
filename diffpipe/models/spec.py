"""What a model family is made of, in one place: :class:`FamilySpec`.

Each family is a folder ``diffpipe/families/<name>/`` with the same file names:

- ``__init__.py``: its ``SPEC`` (this class), the one object the rest of diffpipe reads;
- ``family.py``: the one :class:`~diffpipe.models.base.Family` subclass it defines (components, encoding,
  training inputs, sampling), named by the registry;
- ``layers.py``: its pipeline-parallel layer list (or ``SPEC.layers`` is :class:`Absent` with the reason,
  or names another family's ``layers.py`` it shares);
- ``keymap.py``: ``DENOISER`` and ``build(config, out_features)``, the key map between our module names
  and the original checkpoint's, behind the ComfyUI and kohya formats and ``import-lora``, and ``KOHYA``,
  the metadata a kohya file carries (:class:`Kohya`, or a function of the denoiser config giving one);
  or ``SPEC.keymap`` is :class:`Absent`, and neither format is written;
- ``flavors.py``: its tiny configs (``TINY_VAE``, ``TINY_TRANSFORMER``, ``TINY_SCHEDULER`` by these names, which
  :class:`~diffpipe.models.components.Models` reads) and ``PUBLISHED``, the published models' denoiser configs.

``diffpipe/families/__init__.py`` is the registry (one line per family).
``tests/unit/test_family_contract.py`` checks every registered family against this layout, and the
family, format and pipeline-parallel tables of the docs are generated from the specs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Absent:
    """A spec part a family does not have, and why (shown in the docs and in errors)."""

    reason: str


@dataclass(frozen=True)
class Kohya:
    """The sd-scripts / modelspec metadata a kohya-format file of this family carries."""

    #: ``ss_base_model_version`` (the names sd-scripts and musubi-tuner write).
    base_model_version: str
    #: ``modelspec.architecture``.
    architecture: str
    #: ``modelspec.implementation``.
    implementation: str


@dataclass(frozen=True)
class Published:
    """One published model: its family, denoiser class and config, and what its authors state."""

    name: str
    family: str
    cls: str  # diffusers class name of the denoiser
    config: dict[str, Any]
    params: float  # the published parameter count of the denoiser
    params_digits: int  # significant digits the figure was published with
    source: str  # where the figure is published
    #: Per-sample shapes of the text conditioning (without the batch axis), as the family's loss reads it.
    text: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: VAE latent channels and spatial downsampling (image side / latent side).
    latent_channels: int = 4
    vae_factor: int = 8
    #: The family's ``model.variant`` these weights are (None: the family has one kind of weights).
    variant: str | None = None

    def build_meta(self) -> torch.nn.Module:
        """The denoiser at its published size, on the ``meta`` device (no memory, no weights)."""
        # deferred: the registry and the workflow's digests read specs without torch or diffusers (start-up time)
        import diffusers
        import torch

        with torch.device("meta"):
            return getattr(diffusers, self.cls)(**self.config)

    def params_match(self, count: int) -> bool:
        """Whether ``count`` matches the published figure (see the module docstring)."""
        rounded = float(f"{count:.{self.params_digits}g}")
        return rounded == self.params or abs(count - self.params) <= 0.01 * self.params


def published_series(family: str, cls: str, **shared: Any) -> Callable[..., Published]:
    """A constructor of one family's published models with one denoiser class and the fields they share
    (``text``, ``latent_channels``, ...): ``series(name, config, params, params_digits, source, **own)``."""
    def published(name: str, config: dict[str, Any], params: float, params_digits: int, source: str,
                  **own: Any) -> Published:
        return Published(name, family, cls, config, params, params_digits, source, **{**shared, **own})

    return published


#: :attr:`SampleDefaults.source` of values that are the stock pipeline's own ``__call__`` defaults (a test holds
#: them equal to the installed diffusers').
PIPELINE_DEFAULTS = "the stock pipeline's `__call__` defaults"


@dataclass(frozen=True)
class SampleDefaults:
    """The sampling settings one model of a family is published with: what ``sample.steps`` and
    ``sample.guidance_scale`` resolve to when the config leaves them null."""

    #: Inference steps.
    steps: int
    #: The value passed as the family's ``guidance_arg`` (0 for the distilled models sampled without guidance;
    #: None where the pipeline takes no guidance scale: its guider component holds it).
    guidance_scale: float | None
    #: The model these are for ("FLUX.1-schnell"); "" = the family's models (its spec's ``model``).
    model: str = ""
    #: Where they come from: :data:`PIPELINE_DEFAULTS`, or the publisher's model card (named, not checked here).
    source: str = PIPELINE_DEFAULTS


#: How ComfyUI reads the family's diffusers-format file: ``all`` (it maps the ``transformer.`` names),
#: ``part`` (only the non-attention layers of a UNet), ``none`` (nothing: use the comfyui file),
#: ``no-model`` (ComfyUI has no model for this family).
ComfyReads = Literal["all", "part", "none", "no-model"]


@dataclass(frozen=True, kw_only=True)
class FamilySpec:
    """One model family: where its parts are, and what the docs and the model card say about it.

    A folder's ``SPEC`` leaves ``name`` and ``published`` out: the registry (``diffpipe.families.spec``)
    fills them in from the family's registry line and its ``flavors.PUBLISHED``. Its family class is the
    one :class:`~diffpipe.models.base.Family` subclass its ``family.py`` defines.
    """

    #: The ``model.family`` name (``flux-kontext``); the folder is the name with ``-`` as ``_``.
    name: str = ""
    #: The models it covers, for the docs ("FLUX.1 dev / schnell").
    model: str
    #: What it trains, for the docs ("text-to-image"; video: frame rate and frame rule).
    tasks: str
    #: The default LoRA targets in words, for the docs (the list itself is ``Family.default_lora_targets``).
    targets: str
    #: The published models (``flavors.PUBLISHED``), flagship first.
    published: tuple[Published, ...] = ()
    #: Which tools read its ComfyUI and kohya files, for docs/formats.md ("-": the files are not written).
    comfyui_readers: str
    kohya_readers: str
    #: How ComfyUI reads its diffusers file (the model card's note).
    comfy_reads_diffusers: ComfyReads = "none"
    #: Whether A1111/Forge run this model (the model card's kohya line).
    a1111: bool = False
    #: Model-card "how to load" lines that replace the generic one, by format.
    how_to_load: Mapping[str, str] = field(default_factory=dict)
    #: Pipeline-parallel layers: "" = the folder's ``layers.py``; a module path = another family's it
    #: shares (``diffpipe.families.flux.layers``); :class:`Absent` = none, with the reason.
    layers: str | Absent = ""
    #: The variants or settings whose training the layers refuse (the docs' table says so), "" = none.
    layers_refused: str = ""
    #: The key map: None = the folder's ``keymap.py``; :class:`Absent` = none, with the reason.
    keymap: Absent | None = None
    #: Sampling defaults by sampling key (:meth:`~diffpipe.models.family.sampling.Sampling.sampling_key`: the
    #: family's variant, or what its weights show, such as FLUX.1-schnell's missing guidance embedder); ``None``
    #: is the family's default, taken by every key without an entry of its own.
    sampling: Mapping[str | None, SampleDefaults]

    @property
    def package(self) -> str:
        return f"diffpipe.families.{self.name.replace('-', '_')}"

    def family_type(self) -> type:
        """The :class:`~diffpipe.models.base.Family` subclass the folder's ``family.py`` defines (exactly one;
        imports it and its diffusers classes)."""
        # deferred: models.base imports this module (for Absent), so a module-level import would be circular
        from diffpipe.models.base import Family

        module = importlib.import_module(f"{self.package}.family")
        found = [c for c in vars(module).values()
                 if isinstance(c, type) and issubclass(c, Family) and c.__module__ == module.__name__]
        if len(found) != 1:
            raise TypeError(f"{module.__name__} must define exactly one Family subclass, not "
                            f"{[c.__name__ for c in found]}")
        return found[0]

    def keymap_module(self) -> Any:
        """The ``keymap.py`` module; a clear error when the family has none."""
        if isinstance(self.keymap, Absent):
            raise ValueError(f"no LoRA key map for family {self.name!r} (formats comfyui and kohya need one): "
                             f"{self.keymap.reason}")
        return importlib.import_module(f"{self.package}.keymap")

    def kohya_for(self, denoiser_config: Mapping[str, Any]) -> Kohya:
        """Its kohya metadata (the key map's ``KOHYA``) for a denoiser with this config; a clear error when it
        has none."""
        if isinstance(self.keymap, Absent):
            raise ValueError(f"kohya format: no sd-scripts base model version for family {self.name!r}: "
                             f"{self.keymap.reason}")
        kohya = self.keymap_module().KOHYA
        return kohya if isinstance(kohya, Kohya) else kohya(denoiser_config)


def generic_comfy_names(names: str) -> dict[str, Any]:
    """The spec fields of a family whose comfyui/kohya files only ComfyUI's generic LoRA names (and
    ``diffpipe import-lora``) read (no kohya-family trainer names the model, so its key map's ``KOHYA`` is
    metadata in the same scheme); ``names`` says what follows ``diffusion_model.`` (the original layer
    names). Spread into :class:`FamilySpec`."""
    return {
        "comfyui_readers": f"ComfyUI's generic LoRA names (`diffusion_model.` + {names}); `diffpipe import-lora`",
        "kohya_readers": "ComfyUI's generic LoRA names (`lora_unet_` + the original layer path); "
                         "`diffpipe import-lora`",
    }


def loads_through_transformer(pipeline: str) -> dict[str, Any]:
    """The model card's diffusers line of a family whose stock pipeline has no LoRA loader (``pipeline``: its
    class name): the transformer's own PEFT mixin loads the file (:class:`~diffpipe.models.base.
    TransformerLoRA`). Spread into :class:`FamilySpec` (``**loads_through_transformer(...)``)."""
    return {"how_to_load": {"diffusers": "`pipe.transformer.load_lora_adapter(\"{path}\", prefix=\"transformer\")` "
                                         f"(diffusers 0.42.1's {pipeline} has no `load_lora_weights`)"}}


def diffusers_files_only(reason: str) -> dict[str, Any]:
    """The spec fields of a family whose LoRA is written for diffusers/PEFT only: no key map to the original
    checkpoint names (absent for ``reason``), so no kohya metadata and no ComfyUI or kohya reader. Spread
    into :class:`FamilySpec` (``**diffusers_files_only(reason)``)."""
    return {"keymap": Absent(reason), "comfyui_readers": "-", "kohya_readers": "-"}
