"""Importing this module registers every built-in family (one line each)."""

from diffpipe.models import flux, sd  # noqa: F401
