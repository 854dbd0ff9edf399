"""Sampling with the stock pipeline: the arguments of its ``__call__`` for ``sample`` settings."""

from __future__ import annotations

from typing import Any, ClassVar

from diffpipe.config import SampleConfig
from diffpipe.data.cache.frames import snap_frames


class Sampling:
    """The stock pipeline's sampling arguments (a part of :class:`~diffpipe.models.base.Family`)."""

    #: The pipeline argument ``sample.images`` are passed as (``image``; ``control_image`` for Flux Control).
    sample_image_arg: ClassVar[str] = "image"
    #: Whether samples continue an input clip (``sample.videos``, the pipeline's ``video``).
    continues_video: ClassVar[bool] = False

    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        """Keyword arguments for the stock pipeline's ``__call__``."""
        if cfg.last_images and not self.uses_last_frame:
            raise ValueError(f"sample.last_images: {self.name} has no last-frame input (Wan variant 2.1-flf2v has)")
        out = {
            "num_inference_steps": cfg.steps,
            "guidance_scale": cfg.guidance_scale,
            "height": cfg.height,
            "width": cfg.width,
        }
        if self.is_video:  # clips of a frame count the VAE accepts, as PIL frames
            step, offset = self.frame_rule
            out.update(num_frames=max(offset, snap_frames(cfg.frames, step, offset)), output_type="pil")
        return out

