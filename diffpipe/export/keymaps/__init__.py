"""Per-family key maps between our module names and the original checkpoint's.

One table per family (``sd.py``, ``flux.py``), built from the denoiser's
config; export and import (``diffpipe import-lora``) read the same table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from diffusers import FluxTransformer2DModel, UNet2DConditionModel

from diffpipe.export.keymaps import flux, sd
from diffpipe.export.keymaps.base import KeyMap, Layer, Segment
from diffpipe.models.base import Family

Builder = Callable[[Mapping[str, Any], Mapping[str, int]], KeyMap]
# family name -> (denoiser class, table builder)
_TABLES: dict[str, tuple[type, Builder]] = {
    "sd": (UNet2DConditionModel, sd.build),
    "flux": (FluxTransformer2DModel, flux.build),
}

__all__ = ["KeyMap", "Layer", "Segment", "denoiser_skeleton", "keymap_for", "keymap_for_model"]


def out_features(model: torch.nn.Module) -> dict[str, int]:
    """Output rows of every Linear / Conv2d of ``model``, by module name."""
    sizes = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            sizes[name] = mod.out_features
        elif isinstance(mod, torch.nn.Conv2d):
            sizes[name] = mod.out_channels
    return sizes


def _table(family_name: str) -> tuple[type, Builder]:
    if family_name not in _TABLES:
        raise ValueError(f"no LoRA key map for family {family_name!r}; known: {', '.join(sorted(_TABLES))}")
    return _TABLES[family_name]


def denoiser_skeleton(family: Family) -> torch.nn.Module:
    """The denoiser's modules with their real shapes (weights on the meta device for local models)."""
    if family.cfg.flavor == "tiny":
        return family.load_denoiser()
    cls, _ = _table(family.name)
    config = cls.load_config(family.cfg.path, subfolder=family.denoiser_name)
    with torch.device("meta"):
        return cls.from_config(config)


def keymap_for_model(family_name: str, denoiser: torch.nn.Module) -> KeyMap:
    """The family's table for this denoiser (config and module sizes read from it)."""
    _, build = _table(family_name)
    return build(dict(denoiser.config), out_features(denoiser))


def keymap_for(family: Family) -> KeyMap:
    return keymap_for_model(family.name, denoiser_skeleton(family))
