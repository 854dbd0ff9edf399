"""Published denoiser configurations, written out so nothing has to be downloaded.

Each family's ``flavors.py`` lists its published models (:class:`~diffpipe.models.spec.Published`):
the ``config.json`` of the model's denoiser folder as published on the Hugging Face Hub (keys that
equal the diffusers class's defaults are left out), the parameter count its authors give, and the
per-sample shapes of the text conditioning the denoiser reads. ``diffpipe estimate`` and the
meta-device tests build the denoiser from these on the ``meta`` device: real shapes, no memory, no
weights. This module gathers them from every family folder.
"""

from __future__ import annotations

import importlib

from diffpipe.families import FAMILIES, UNREGISTERED, spec
from diffpipe.models.spec import Published

__all__ = ["PUBLISHED", "Published", "for_family", "published"]


def _gather() -> dict[str, Published]:
    out: dict[str, Published] = {}
    for name in [*FAMILIES, *UNREGISTERED]:
        for p in importlib.import_module(f"diffpipe.families.{name.replace('-', '_')}.flavors").PUBLISHED:
            if p.name in out:
                raise ValueError(f"published model {p.name!r} is listed by two families")
            out[p.name] = p
    return out


PUBLISHED: dict[str, Published] = _gather()


def published(name: str) -> Published:
    """The published model ``name``; a clear error naming the known ones."""
    if name not in PUBLISHED:
        raise ValueError(f"unknown published model {name!r}; known: {', '.join(sorted(PUBLISHED))}")
    return PUBLISHED[name]


def for_family(family: str) -> list[Published]:
    """The published models of one family (the first is its flagship), from its spec."""
    return list(spec(family).published)
