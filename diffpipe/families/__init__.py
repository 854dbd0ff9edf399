"""The model families: one folder each (see ``diffpipe.models.spec``), one line each here.

Adding a family is adding its folder and its line; ``tests/unit/test_family_contract.py`` checks
that every folder here is registered (or listed in ``UNREGISTERED`` with the reason) and that each
registered family's spec parts exist. A family's modules are imported on first use, so a cache or
sample job pays only for its own family's imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from diffpipe.models.spec import Absent

if TYPE_CHECKING:
    from diffpipe.models.spec import FamilySpec

__all__ = ["FAMILIES", "UNREGISTERED", "Absent", "family_names", "spec", "specs"]

#: ``model.family`` name -> its folder under ``diffpipe/families/``.
FAMILIES: dict[str, str] = {
    "sd": "sd",
    "sdxl": "sdxl",
    "sd3": "sd3",
    "flux": "flux",
    "flux-kontext": "flux_kontext",
    "flux-control": "flux_control",
    "chroma": "chroma",
    "lumina2": "lumina2",
    "qwenimage": "qwenimage",
    "qwenimage-edit": "qwenimage_edit",
    "hidream": "hidream",
    "cogview4": "cogview4",
    "cosmos2": "cosmos2",
    "wan": "wan",
    "ltxvideo": "ltxvideo",
    "cogvideox": "cogvideox",
    "hunyuanvideo": "hunyuanvideo",
    "cosmos2-video": "cosmos2_video",
    "mochi": "mochi",
}

#: Folders that are not families yet, and why (their published sizes still feed the docs).
UNREGISTERED: dict[str, str] = {
    "hunyuanimage": "diffusers 0.42.1's HunyuanImagePipeline has no LoRA loader, so the diffusers-format "
                    "export the workflow always writes and load_lora_weights cannot work",
}


def family_names() -> list[str]:
    """The registered families' names, sorted."""
    return sorted(FAMILIES)


def spec(name: str) -> FamilySpec:
    """The spec of a registered family; a clear error naming the known ones."""
    if name not in FAMILIES:
        raise ValueError(f"model.family: unknown family {name!r}; known: {', '.join(family_names())}")
    return importlib.import_module(f"{__name__}.{FAMILIES[name]}").SPEC


def specs() -> list[FamilySpec]:
    """Every registered family's spec, in the registry's order (the docs' table order)."""
    return [spec(name) for name in FAMILIES]
