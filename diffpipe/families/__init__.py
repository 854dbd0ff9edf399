"""The model families: one folder each (see ``diffpipe.models.spec``), one line each here.

Adding a family is adding its folder and its line; ``tests/unit/test_family_contract.py`` checks
that every folder here is registered (or listed in ``UNREGISTERED`` with the reason) and that each
registered family's spec parts exist. A family's modules are imported on first use, so a cache or
sample job pays only for its own family's imports.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from diffpipe import hub
from diffpipe.config import ConfigError, ModelConfig
from diffpipe.models.spec import Absent

if TYPE_CHECKING:
    from diffpipe.models.base import Family
    from diffpipe.models.spec import FamilySpec

__all__ = ["FAMILIES", "NOT_IMPLEMENTED", "UNREGISTERED", "Absent", "family_names", "detect_family", "get_family", "pipeline_families",
           "resolve_family", "spec", "specs"]

#: ``model.family`` name -> its folder under ``diffpipe/families/``.
FAMILIES: dict[str, str] = {
    "sd": "sd",
    "sdxl": "sdxl",
    "sd3": "sd3",
    "flux": "flux",
    "flux-kontext": "flux_kontext",
    "flux-control": "flux_control",
    "flux2": "flux2",
    "flux2-klein": "flux2_klein",
    "chroma": "chroma",
    "sana": "sana",
    "auraflow": "auraflow",
    "lumina2": "lumina2",
    "zimage": "zimage",
    "ernie-image": "ernie_image",
    "krea2": "krea2",
    "ideogram4": "ideogram4",
    "qwenimage": "qwenimage",
    "qwenimage-edit": "qwenimage_edit",
    "hidream": "hidream",
    "cogview4": "cogview4",
    "hunyuanimage": "hunyuanimage",
    "cosmos2": "cosmos2",
    "wan": "wan",
    "skyreels-v2": "skyreels_v2",
    "helios": "helios",
    "ltxvideo": "ltxvideo",
    "ltx2": "ltx2",
    "cogvideox": "cogvideox",
    "hunyuanvideo": "hunyuanvideo",
    "hunyuanvideo15": "hunyuanvideo15",
    "kandinsky5": "kandinsky5",
    "kandinsky5-image": "kandinsky5_image",
    "cosmos2-video": "cosmos2_video",
    "mochi": "mochi",
}

#: Folders that are not families yet, and why (their published sizes still feed the docs).
UNREGISTERED: dict[str, str] = {}


_TORCHVISION = ("the torchvision wheels for torch 2.13 on PyPI are built for the CUDA torch and fail to import "
                "with the CPU build diffpipe is tested on (`operator torchvision::nms does not exist`), so diffpipe "
                "does not install it")
_MODULAR = "diffusers 0.42.1 ships it only as a modular pipeline; diffpipe builds on the standard pipelines"
#: Models users may look for that are not families, and why: ``name -> (the pinned diffusers' LoRA loader
#: mixin for it, or None; the reason)``. ``tests/unit/test_family_contract.py`` checks that every LoRA
#: loader mixin of the pinned diffusers is used by a registered family's pipeline or listed here.
NOT_IMPLEMENTED: dict[str, tuple[str | None, str]] = {
    "OmniGen2": (None, "diffusers 0.42.1 has no OmniGen2 classes (only OmniGen v1's, without a LoRA loader)"),
    "PixArt-α / PixArt-Σ": (None, "diffusers 0.42.1's PixArt pipelines have no LoRA loader and its "
                           "PixArtTransformer2DModel no PEFT mixin (no `load_lora_adapter`), so no diffusers API "
                           "would load the LoRA"),
    "Bria FIBO 2": ("BriaFibo2LoraLoaderMixin", "not written yet. Its pipeline encodes with a Qwen3VLProcessor, which "
                    "transformers builds only with torchvision (" + _TORCHVISION + "); for text the processor's "
                    "tokenizer would serve, as for FLUX.2 [dev], but Fibo 2 also reads structured JSON captions, "
                    "draws images of their text for Qwen3-VL and guides with a JSON null caption, which the caches "
                    "and caption dropout would have to follow"),
    "FLUX.3": ("Flux3LoraLoaderMixin", _MODULAR),
    "Anima": ("AnimaLoraLoaderMixin", _MODULAR),
    "MiniMax H3": ("MiniMaxH3LoraLoaderMixin", _MODULAR),
    "aMUSEd": ("AmusedLoraLoaderMixin", "no pipeline of diffusers 0.42.1 uses its LoRA loader"),
    "ACE-Step": ("AceStepLoraLoaderMixin", "an audio model: diffpipe trains image and video models"),
    "RFD4 Proteina": ("RFD4ProteinaLoraLoaderMixin", "a protein structure model: diffpipe trains image and "
                      "video models"),
}


def family_names() -> list[str]:
    """The registered families' names, sorted."""
    return sorted(FAMILIES)


def spec(name: str) -> FamilySpec:
    """The spec of a registered family, its name and published models filled in (its folder's ``SPEC``
    leaves them out); a clear error naming the known ones."""
    if name not in FAMILIES:
        raise ValueError(f"model.family: unknown family {name!r}; known: {', '.join(family_names())}")
    package = f"{__name__}.{FAMILIES[name]}"
    declared = importlib.import_module(package).SPEC
    published = declared.published or tuple(importlib.import_module(f"{package}.flavors").PUBLISHED)
    return dataclasses.replace(declared, name=name, published=published)


def specs() -> list[FamilySpec]:
    """Every registered family's spec, in the registry's order (the docs' table order)."""
    return [spec(name) for name in FAMILIES]


def get_family(cfg: ModelConfig) -> Family:
    """The family instance for a model config (resolved: :func:`resolve_family`); a clear error for an
    unknown name."""
    cfg = resolve_family(cfg)
    cls = spec(cfg.family).family_type()
    return cls(hub.resolved(cfg))  # a Hugging Face id becomes its cached snapshot folder


@functools.cache
def pipeline_families() -> dict[str, str]:
    """diffusers pipeline class name -> family name, from the registered families themselves."""
    table: dict[str, str] = {}
    for name in family_names():
        family = get_family(ModelConfig(family=name))
        for variant in getattr(family, "variants", ()) or (None,):
            try:
                one = get_family(ModelConfig(family=name, variant=variant)) if variant else family
            except ValueError:  # a variant that needs more settings (Wan 2.2 A14B: an expert)
                continue
            table.setdefault(one.pipeline_class.__name__, name)
    return table


def detect_family(index_file: Path) -> str | None:
    """The family whose pipeline a ``model_index.json`` names (None: absent, or no family's pipeline)."""
    name = hub.pipeline_class(index_file)
    return pipeline_families().get(name) if name else None


def _family(cfg: ModelConfig, base: Path) -> str:
    """The family of the local model ``cfg`` names: detected, or the given one checked against the model."""
    try:
        index = hub.model_index(cfg.path, cfg.revision, base)
    except ConfigError as err:
        raise ConfigError(f"model.path {cfg.path!r}: {err}") from None
    detected = detect_family(index)
    if cfg.family is None and detected is None and not index.is_file():
        return "sd"  # a local folder without an index: the default before detection existed
    if cfg.family is None:
        if detected is None:
            raise ConfigError(f"model.family is not given and cannot be detected from {index} (missing, or a "
                              "pipeline no family loads): set model.family")
        return detected
    if detected is not None and detected != cfg.family:
        raise ConfigError(f"model.family {cfg.family!r} does not match the model at model.path {cfg.path!r}: its "
                          f"{index} names a {detected} pipeline; set model.family: {detected} or remove it")
    return cfg.family


def resolve_family(cfg: ModelConfig, base: str | Path | None = None) -> ModelConfig:
    """``cfg`` with its family read from the local model's ``model_index.json`` (relative paths start at
    ``base``, default the working folder); a tiny flavor is returned as it is."""
    if cfg.flavor != "local" or cfg.path is None:
        return cfg
    family = _family(cfg, Path(base or ".").absolute())
    if family == cfg.family:
        return cfg
    try:
        out = ModelConfig.model_validate({**cfg.model_dump(exclude_unset=True), "family": family})
    except ValueError as err:  # a check that needs the family (model.zero_terminal_snr)
        raise ConfigError(f"model: {err}") from None
    out._origin = cfg._origin
    return out
