"""``export``: the LoRA file formats written."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from diffpipe.config.base import Section

ExportFormat = Literal["diffusers", "peft", "comfyui", "kohya", "merged"]


class ExportConfig(Section):
    formats: list[ExportFormat] = Field(
        ["diffusers"],
        description="Export formats to write: `diffusers`, `peft`, `comfyui`, `kohya`, `merged` (the workflow "
        "always adds the one samples read: `diffusers`, or `peft` for LoKr/LoHa, whose default is `[peft]`).",
        min_length=1,
    )
