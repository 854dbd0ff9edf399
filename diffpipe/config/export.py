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
    include_base_loras: bool = Field(
        False,
        description="Merge `model.base_loras` into the exported LoRA, so the file alone reproduces training: the "
        "trained LoRA's ranks and each base LoRA's concatenated with their scales folded in (modules only a base "
        "LoRA touches added), text encoders' parts too; the `merged` folder gets them folded into its weights. "
        "Plain LoRAs only: a LoKr, LoHa or DoRA (trained or base) is refused by name for the LoRA file formats. "
        "Off: the files hold the trained LoRA alone and the card says how to load the base LoRAs beside it (a "
        "training adapter that de-distills the base is meant to be left out).",
    )
