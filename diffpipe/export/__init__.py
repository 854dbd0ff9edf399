"""LoRA export formats."""

from diffpipe.export.diffusers_format import export_diffusers

__all__ = ["export_diffusers"]
