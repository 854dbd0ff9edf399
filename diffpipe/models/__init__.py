"""Shared machinery of the model families (the families themselves are in ``diffpipe/families/``)."""

from diffpipe.models.base import Family, family_names, get_family

__all__ = ["Family", "family_names", "get_family"]
