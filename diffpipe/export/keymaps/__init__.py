"""Per-family key maps between our module names and the original checkpoint's.

Each family's folder has a ``keymap.py`` (unless its spec says the key map is absent) holding
``DENOISER`` (the diffusers denoiser class) and ``build(config, out_features)`` (the table).
Export and import (``diffpipe import-lora``) read the same table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from diffpipe.families import Absent, spec, specs
from diffpipe.models.base import Family
from diffpipe.models.keymap import LORA_LAYERS, KeyMap, Layer, Segment

Builder = Callable[[Mapping[str, Any], Mapping[str, int]], KeyMap]

__all__ = [
    "KeyMap",
    "Layer",
    "Segment",
    "denoiser_skeleton",
    "keymap_for",
    "keymap_for_model",
    "mapped_families",
]


def out_features(model: torch.nn.Module) -> dict[str, int]:
    """Output rows of every LoRA-able module (Linear, Conv2d, Conv3d) of ``model``, by module name."""
    sizes = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            sizes[name] = mod.out_features
        elif isinstance(mod, LORA_LAYERS):
            sizes[name] = mod.out_channels
    return sizes


def mapped_families() -> list[str]:
    """Families that have a key map (and so the comfyui and kohya formats)."""
    return sorted(s.name for s in specs() if not isinstance(s.keymap, Absent))


def _table(family_name: str) -> tuple[type, Builder]:
    """``(denoiser class, table builder)`` of a family."""
    module = spec(family_name).keymap_module()
    return module.DENOISER, module.build


def denoiser_skeleton(family: Family) -> torch.nn.Module:
    """The denoiser's modules with their real shapes (weights on the meta device for local models)."""
    if family.cfg.flavor == "tiny":
        return family.load_denoiser()
    cls, _ = _table(family.name)
    config = cls.load_config(family.cfg.path, subfolder=family.denoiser_attr)
    with torch.device("meta"):
        return cls.from_config(config)


def keymap_for_model(family_name: str, denoiser: torch.nn.Module) -> KeyMap:
    """The family's table for this denoiser (config and module sizes read from it)."""
    _, build = _table(family_name)
    return build(dict(denoiser.config), out_features(denoiser))


def keymap_for(family: Family) -> KeyMap:
    return keymap_for_model(family.name, denoiser_skeleton(family))
