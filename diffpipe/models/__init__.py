"""Shared machinery of the model families (the families and their registry are in ``diffpipe/families/``).

Nothing is imported here: ``diffpipe.models.spec`` (what the registry and the workflow's digests read) must
load without torch or diffusers; ``from diffpipe.models import Family`` still works, on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from diffpipe.models.base import Family

__all__ = ["Family"]


def __getattr__(name: str) -> Any:
    if name == "Family":
        # deferred: models.base imports torch and diffusers; the spec and registry readers must not pay it (start-up time)
        from diffpipe.models.base import Family

        return Family
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
