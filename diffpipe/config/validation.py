"""``validation``: which files a dataset check accepts, and what each reason code does."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from diffpipe.config.base import MAX_FRAMES, MAX_SIDE, AspectRatio, Int, Section, Text
from diffpipe.policy import resolve_actions


class ValidationConfig(Section):
    image_exts: list[Text] = Field(
        [".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff"], description="File extensions treated as images."
    )
    min_size: Int = Field(16, description="Smallest accepted image side in pixels.", ge=1, le=MAX_SIDE)
    video_exts: list[Text] = Field(
        [".mp4", ".webm", ".mov", ".mkv", ".gif"],
        description="File extensions treated as videos (decoded with PyAV; frames and fps measured by decoding).",
    )
    min_frames: Int = Field(1, description="Fewest decoded frames a video must have.", ge=1, le=MAX_FRAMES)
    aspect_range: tuple[AspectRatio, AspectRatio] = Field(
        (0.25, 4.0), description="Accepted width / height ratios, [smallest, largest]."
    )
    max_pixels: Int = Field(
        178_956_970,
        description="Files whose header declares more pixels (an image, a GIF's screen or any of its frames, "
        "a video frame) are flagged `decompression_bomb` and never decoded, in validation and in the cache jobs "
        "(Pillow's own limit by default).",
        ge=1,
        le=2**40,
    )
    shards: Int = Field(
        1,
        description="Validation jobs that probe (hash and decode) a part of the listing each, split by path hash "
        "(a table dataset by table file), before one job merges their results and runs the checks over all items; a changed file reruns only its "
        "shard's job. 1: validation is one job (faster for small datasets; see docs/validation.md).",
        ge=1,
        le=4096,
    )
    actions: dict[str, Literal["error", "skip", "warn"]] = Field(
        {}, description="Per reason code, override the default action (`error`, `skip` or `warn`); see the "
        "reason table in docs/validation.md."
    )

    @model_validator(mode="after")
    def _check(self) -> ValidationConfig:
        lo, hi = self.aspect_range
        if not 0 < lo <= hi:
            raise ValueError(f"validation.aspect_range must be [smallest, largest] > 0, got {[lo, hi]}")
        resolve_actions(self.actions)
        return self
