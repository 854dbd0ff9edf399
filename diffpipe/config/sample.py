"""``sample``: the sample images and clips rendered with the trained weights."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from diffpipe.config.base import MAX_FRAMES, MAX_SIDE, Float, Int, PathText, Section, Seed


class SampleConfig(Section):
    prompts: list[str] = Field(
        ["a red circle"], description="Prompts rendered with the trained LoRA.", min_length=1, max_length=10_000
    )
    steps: Int | None = Field(
        None, description="Inference steps. null: the default of the model's family and variant (the table in "
        "docs/training.md: FLUX.1-schnell 4, Z-Image Turbo 9, most undistilled bases their pipeline's own default).",
        ge=1, le=10_000,
    )
    guidance_scale: Float | None = Field(
        None, description="Guidance scale, as the family's pipeline takes it (classifier-free for most; FLUX.1-dev's "
        "is embedded guidance, Qwen-Image's `true_cfg_scale`). null: the default of the model's family and variant "
        "(FLUX.1-schnell and Z-Image Turbo 0: no guidance). Over a speed LoRA in `model.base_loras` (Lightning, "
        "LightX2V) set both: the defaults are the base's.", ge=0,
    )
    seed: Seed = Field(0, description="Seed of the sampling noise.")
    width: Int = Field(64, description="Sample width in pixels.", gt=0, le=MAX_SIDE)
    height: Int = Field(64, description="Sample height in pixels.", gt=0, le=MAX_SIDE)
    frames: Int = Field(
        5, description="Frames per sample clip for video families (snapped to the model's frame rule); "
        "image families ignore it.", ge=1, le=MAX_FRAMES,
    )
    images: list[PathText | list[PathText]] | None = Field(
        None, description="One conditioning image per prompt (file paths), for image-conditioned models "
        "(Wan 2.1 I2V: the first frame of each sample clip); a list of paths for a prompt's several reference "
        "images (Qwen-Image-Edit `variant: 2509 | 2511`); null: text only.",
    )
    videos: list[PathText] | None = Field(
        None, description="One input clip per prompt (file paths), for video-to-video models (SkyReels V2 "
        "`variant: df-v2v`: each sample continues its clip's last `model.prefix_frames` frames); null: none.",
    )
    last_images: list[PathText] | None = Field(
        None, description="One last frame per prompt (file paths), for first-and-last-frame models (Wan "
        "`variant: 2.1-flf2v`, with `images` as the first frames); null: none.",
    )
    offload: Literal["auto", "none", "group"] = Field(
        "auto", description="Where samples keep the pipeline's weights on a GPU machine: `none` = all on the "
        "GPU; `group` = in CPU memory, each block brought to the GPU for its forward (diffusers' group "
        "offloading: slower, fits a pipeline larger than the card, such as Wan 2.2 A14B's or Ideogram 4's two "
        "transformers); `auto` = `none` when the weights take under 80% of the free GPU memory, else `group`. "
        "`diffpipe sample` places every component; the in-training sampler (`train.sample_every_*`) the "
        "frozen ones (text encoders, VAE), beside the training model. Without a GPU the pipeline runs on the "
        "CPU (`group` still applies its hooks there).",
    )

    @model_validator(mode="after")
    def _one_image_per_prompt(self) -> SampleConfig:
        for key in ("images", "last_images", "videos"):
            paths = getattr(self, key)
            if paths is not None and len(paths) != len(self.prompts):
                raise ValueError(
                    f"sample.{key} has {len(paths)} path(s) for {len(self.prompts)} prompt(s); give one per prompt"
                )
        if self.last_images is not None and self.images is None:
            raise ValueError("sample.last_images needs sample.images: a clip's first frames beside its last ones")
        return self
