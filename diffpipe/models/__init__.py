"""Shared machinery of the model families (the families and their registry are in ``diffpipe/families/``)."""

from diffpipe.models.base import Family

__all__ = ["Family"]
