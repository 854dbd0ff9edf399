"""Model families behind one interface (see ``base.Family``)."""

from diffpipe.models.base import Family, family_names, get_family, register

__all__ = ["Family", "family_names", "get_family", "register"]
