"""Importing this module registers every built-in family (one line each)."""

from diffpipe.models import (  # noqa: F401
    chroma,
    flux,
    hidream,
    lumina2,
    qwenimage,
    sd,
    sd3,
    sdxl,
)
