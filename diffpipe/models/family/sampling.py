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
    #: The pipeline argument ``sample.guidance_scale`` is passed as (None: the pipeline takes no guidance scale;
    #: its guider component holds it).
    guidance_arg: ClassVar[str | None] = "guidance_scale"

    def sampling_key(self) -> str | None:
        """Which entry of the family spec's ``sampling`` table this model samples with by default: its
        ``model.variant`` as resolved (None: the family's one kind of weights)."""
        return getattr(self, "variant", None)

    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        """Keyword arguments for the stock pipeline's ``__call__``; ``cfg`` resolved
        (:func:`diffpipe.families.sampling.resolve_sample`: no null steps or guidance scale)."""
        if cfg.last_images and not self.uses_last_frame:
            raise ValueError(f"sample.last_images: {self.name} has no last-frame input (Wan variant 2.1-flf2v has)")
        if cfg.steps is None or (cfg.guidance_scale is None and self.guidance_arg is not None):  # not resolved
            raise ValueError("sample.steps / sample.guidance_scale are null here: resolve them first "
                             "(diffpipe.families.sampling.resolve_sample)")
        out: dict[str, Any] = {"num_inference_steps": cfg.steps, "height": cfg.height, "width": cfg.width}
        if self.guidance_arg is not None:
            out[self.guidance_arg] = cfg.guidance_scale
        if self.is_video:  # clips of a frame count the VAE accepts, as PIL frames
            step, offset = self.frame_rule
            out.update(num_frames=max(offset, snap_frames(cfg.frames, step, offset)), output_type="pil")
        return out
