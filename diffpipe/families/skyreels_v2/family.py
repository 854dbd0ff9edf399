"""Family ``skyreels-v2``: SkyReels V2 text-to-video and image-to-video, on Wan 2.1's parts.

SkyReels V2 is Wan 2.1's architecture trained further: the same UMT5 text encoder, causal 3-D VAE and
transformer layout (``SkyReelsV2Transformer3DModel`` has Wan's module names and weights' shapes, and
diffusers reads its LoRAs with Wan's converters), sampled at 24 fps. So the family is ``wan``'s with its
own transformer class, pipelines and published sizes; Wan's key map, pipeline layers and training
inputs serve it unchanged.

Variants (``model.variant``; a local folder's is read from its pipeline class, ``df``, or its
transformer config, ``i2v`` where it has an image embedder):

- ``t2v`` (``SkyReelsV2Pipeline``, UniPC flow shift 8): text-to-video, as ``wan`` ``2.1``.
- ``i2v`` (``SkyReelsV2ImageToVideoPipeline``, flow shift 5): the 36-channel transformer with a CLIP
  image embedder, conditioned exactly as ``wan`` ``2.1-i2v`` (the pipeline's ``prepare_latents`` and
  ``encode_image`` are Wan 2.1 I2V's): each item's control image (or its own first frame,
  ``control_from_first_frame``) is cached as its condition latents and CLIP hidden states. The
  published folders name a ``CLIPVisionModelWithProjection`` and a ``CLIPProcessor``; the
  penultimate hidden states the pipeline reads are the vision tower's, which ``CLIPVisionModel`` and
  the processor's image part load from the same files.
- ``df`` (``SkyReelsV2DiffusionForcingPipeline``, flow shift 8): the diffusion-forcing checkpoints
  (T2V's architecture; the 1.3B one adds a frame-rate embedding, ``inject_sample_info``). The
  pipeline gives every latent frame its own timestep (``timestep`` ``[B, F]`` with
  ``enable_diffusion_forcing=True`` and ``fps``); in its asynchronous schedule earlier frames are
  further denoised than later ones. So training draws one noise level per causal block (the
  transformer's ``num_frame_per_block``, 1 in the published configs) from the configured timestep
  distribution, sorts them along time (earlier frames never noisier), and noises each frame at its
  own level; a given ``t`` (evaluation quantiles) puts every frame of a clip at that level, as the
  synchronous schedule (``ar_step=0``, the sampler's default here) does. ``fps`` is the pipeline's
  index (0 for 16 fps, else 1; clips train at 24 fps).
- ``df-i2v`` (``SkyReelsV2DiffusionForcingImageToVideoPipeline``; the ``df`` weights, a DF folder is
  accepted): ``df`` started from an image. The pipeline encodes the image alone as a one-frame clip
  and puts its latents in the first latent frame, at timestep 0 there (a pre-ready frame); so each
  item's control image (or its own first frame, ``control_from_first_frame``) is cached as its
  one-frame latents, replaces the first latent frame at level 0, and that frame is left out of the
  loss. The pipeline marks the frame ready only in causal blocks of one frame: other block sizes are
  refused.
- ``df-v2v`` (``SkyReelsV2DiffusionForcingVideoToVideoPipeline``; the ``df`` weights): ``df`` continuing a
  clip. The pipeline encodes the last ``overlap_history`` frames of its input clip alone and puts their
  latents first, at timestep 0 (ready frames), truncated to whole causal blocks. The VAE is causal, so a
  clip's first ``(P - 1) / 4 + 1`` latent frames are exactly the latents of its first ``P`` frames encoded
  alone: training keeps those frames of each clip clean at level 0 and out of the loss (``P`` =
  ``model.prefix_frames``, default 17), and the rest are noised as ``df`` noises them. No control image
  is needed; samples continue ``sample.videos`` (the pipeline returns the input clip followed by the new
  one, whose first frames re-render the input's last).
"""

from __future__ import annotations

import dataclasses
import json
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import torch
from diffusers import (
    SkyReelsV2DiffusionForcingImageToVideoPipeline,
    SkyReelsV2DiffusionForcingPipeline,
    SkyReelsV2DiffusionForcingVideoToVideoPipeline,
    SkyReelsV2ImageToVideoPipeline,
    SkyReelsV2Pipeline,
    SkyReelsV2Transformer3DModel,
)

from diffpipe.families.wan.family import VARIANTS as WAN_VARIANTS
from diffpipe.families.wan.family import WanFamily, WanVariant
from diffpipe.families.wan.flavors import TINY_TRANSFORMER, TINY_VAE
from diffpipe.models import _common as common
from diffpipe.models import _video as video
from diffpipe.models import objectives as obj
from diffpipe.models.base import Prepared

#: The versions: Wan 2.1's tiny parts (T2V, and I2V's 36-channel transformer with its image embedder), seeded
#: apart; each pipeline's published flow shift.
VARIANTS = {
    "t2v": WanVariant(TINY_VAE, TINY_TRANSFORMER, 8.0, seed_prefix="skyreels-v2"),
    "i2v": dataclasses.replace(WAN_VARIANTS["2.1-i2v"], flow_shift=5.0, seed_prefix="skyreels-v2-i2v"),
    # with the frame-rate embedding of the 1.3B checkpoint, so the tiny model exercises it
    "df": WanVariant(TINY_VAE, {**TINY_TRANSFORMER, "inject_sample_info": True}, 8.0, seed_prefix="skyreels-v2-df"),
}
#: The DF weights started from an image (the I2V pipeline's flow shift, 5).
VARIANTS["df-i2v"] = dataclasses.replace(VARIANTS["df"], flow_shift=5.0, image_to_video=True, weights_of="df")
#: The DF weights continuing a clip: its first ``model.prefix_frames`` frames clean (the DF flow shift, 8).
VARIANTS["df-v2v"] = dataclasses.replace(VARIANTS["df"], weights_of="df")
#: The diffusion-forcing variants.
DF = ("df", "df-i2v", "df-v2v")
#: ``model.prefix_frames`` when unset: the smaller ``overlap_history`` the video-to-video pipeline suggests.
DEFAULT_PREFIX_FRAMES = 17
#: The pipelines' ``fps`` input: an index, 0 for 16 fps, 1 otherwise.
_FPS_INDEX = {16: 0}


class SkyReelsV2Family(WanFamily):
    fps = 24.0
    variants: ClassVar[tuple[str, ...]] = tuple(VARIANTS)
    variant_table = VARIANTS
    transformer_cls = SkyReelsV2Transformer3DModel
    model_label = "SkyReels V2"
    extra_single_files = ()

    def __init__(self, cfg):
        super().__init__(cfg)
        if cfg.prefix_frames is not None and self.variant != "df-v2v":
            raise ValueError(f"model.prefix_frames: only skyreels-v2 variant df-v2v continues a clip; this model is "
                             f"{self.model_label} {self.variant}")
        #: ``df-v2v``: the clean frames at each clip's start (the pipeline's ``overlap_history``).
        self.prefix_frames = cfg.prefix_frames or DEFAULT_PREFIX_FRAMES
        self.continues_video = self.variant == "df-v2v"
        step, offset = self.frame_rule
        if (self.prefix_frames - offset) % step:
            raise ValueError(f"model.prefix_frames {self.prefix_frames}: give {step}k+{offset} frames (17, 37, ...), "
                             "whole latent frames of the causal VAE")

    @staticmethod
    def detect_variant(path: str | Path) -> str | None:
        """``df`` where the folder's pipeline is the diffusion-forcing one, ``i2v`` where the transformer has
        an image embedder (``image_dim``), else ``t2v``."""
        path = Path(path)
        if not (path / "transformer" / "config.json").is_file():
            return None
        index = path / "model_index.json"
        df_pipelines = (SkyReelsV2DiffusionForcingPipeline.__name__, SkyReelsV2DiffusionForcingImageToVideoPipeline.__name__)
        if index.is_file() and json.loads(index.read_text()).get("_class_name") in df_pipelines:
            return "df"  # the same weights serve both pipelines: df-i2v is asked for
        config = SkyReelsV2Transformer3DModel.load_config(path, subfolder="transformer")
        return "i2v" if config.get("image_dim") else "t2v"

    @property
    def pipeline_class(self) -> type:
        if self.variant == "df-v2v":
            return SkyReelsV2DiffusionForcingVideoToVideoPipeline
        if self.variant in DF:
            return SkyReelsV2DiffusionForcingImageToVideoPipeline if self.spec.image_to_video else \
                SkyReelsV2DiffusionForcingPipeline
        return SkyReelsV2ImageToVideoPipeline if self.spec.image_to_video else SkyReelsV2Pipeline

    def load_pipeline(self) -> SkyReelsV2Pipeline | SkyReelsV2ImageToVideoPipeline | SkyReelsV2DiffusionForcingPipeline:
        enc = self.load_text_encoders()
        parts = {"tokenizer": enc.tokenizer, "text_encoder": enc.text_encoder, "vae": self.load_vae(),
                 "transformer": self._load_transformer("transformer"), "scheduler": self.inference_scheduler()}
        if self.spec.image_embeds:
            parts["image_encoder"], parts["image_processor"] = self.load_image_encoder()
        return self.pipeline_class(**parts)

    def sizes(self, published) -> bool:
        """Diffusion forcing's inputs (per-frame timesteps, a frame rate) only for its own checkpoints."""
        return super().sizes(published) and (published.variant in DF) == (self.variant in DF)

    # -- diffusion forcing ---------------------------------------------------------
    @cached_property
    def frames_per_block(self) -> int:
        """The transformer's causal block (``num_frame_per_block``): latent frames that share a noise level."""
        config = (self.spec.transformer if self.cfg.flavor == "tiny"
                  else SkyReelsV2Transformer3DModel.load_config(self.cfg.path, subfolder="transformer"))
        return int(config.get("num_frame_per_block", 1))

    def _clip_sigmas(self, o, x0, generator, t):
        """``df``: a noise level per latent frame ``[B, F]``, non-decreasing along time (see the module doc)."""
        if self.variant not in DF:
            return super()._clip_sigmas(o, x0, generator, t)
        b, frames = x0.shape[0], x0.shape[2]
        if t is not None:  # one given level a clip: the synchronous schedule
            return self._sigmas(o, b, generator, t)[:, None].expand(b, frames)
        block = self.frames_per_block
        if self.spec.image_to_video and block != 1:
            raise ValueError(f"skyreels-v2 df-i2v: the transformer's causal blocks are {block} frames; the pipeline "
                             "marks the image's latent frame as ready only in blocks of one frame")
        if frames % block:
            raise ValueError(f"skyreels-v2 df: {frames} latent frames are not whole causal blocks of {block} "
                             "(the transformer's num_frame_per_block); pick frame buckets that make them")
        sigma = self._sigmas(o, b * (frames // block), generator, None).view(b, -1).sort(dim=1).values
        return sigma.repeat_interleave(block, dim=1)

    def prefix_latent_frames(self, frames: int) -> int:
        """``df-v2v``: the clean latent frames of a clip of ``frames`` latent frames: ``prefix_frames``'
        latent frames, cut to whole causal blocks as the pipeline cuts them; a clear error when none is left
        to denoise."""
        step, _ = self.frame_rule
        n = (self.prefix_frames - 1) // step + 1
        n -= n % self.frames_per_block
        if n >= frames:
            raise ValueError(f"skyreels-v2 df-v2v: clips of {frames} latent frames leave none after the "
                             f"{n}-latent-frame prefix (model.prefix_frames {self.prefix_frames}); train on longer "
                             "clips (datasets[].frame_buckets) or lower model.prefix_frames")
        return n

    def encode_control(self, vae: torch.nn.Module, control: torch.Tensor, *, frames: int) -> dict[str, torch.Tensor]:
        """``df-i2v``: the image alone as a one-frame clip, as the pipeline encodes it."""
        if self.variant != "df-i2v":
            return super().encode_control(vae, control, frames=frames)
        return {"control": self.encode_pixels(vae, control[:, :, :1])}

    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32, control=None, control_embeds=None) -> Prepared:
        """``df``: each latent frame noised at its own level, the transformer told each frame's timestep;
        ``df-i2v``: the first latent frame is the image's, clean, at level 0, and out of the loss."""
        if self.variant not in DF:
            return super().prepare(latents, text, generator, objective=objective, t=t, noise=noise, mask=mask,
                                   dtype=dtype, control=control, control_embeds=control_embeds)
        if self.spec.image_to_video:
            video.require_first_frame(control, "df-i2v")
        x0, sigma, noise = self._draw(latents, generator, t, noise, objective)
        weights = self.loss_mask(mask, x0, objective)
        ready = 0  # leading latent frames given clean, at level 0, out of the loss
        if self.spec.image_to_video:
            ready = 1
            x0 = torch.cat([control[:, :, :1].to(x0), x0[:, :, 1:]], dim=2)
        elif self.variant == "df-v2v":
            ready = self.prefix_latent_frames(x0.shape[2])  # the clip's own first frames
        if ready:
            sigma = torch.cat([torch.zeros_like(sigma[:, :ready]), sigma[:, ready:]], dim=1)
            keep = torch.ones_like(x0[:, :1])
            keep[:, :, :ready] = 0
            weights = keep.expand(x0.shape) * (1 if weights is None else weights)
        frame_sigma = sigma[:, None, :, None, None]
        inputs = {
            "hidden_states": ((1 - frame_sigma) * x0 + frame_sigma * noise).to(dtype),
            "timestep": sigma * self._scheduler_config.get("num_train_timesteps", 1000),
            "encoder_hidden_states": text["prompt_embeds"].to(device=x0.device, dtype=dtype),
            "enable_diffusion_forcing": True,
            "fps": [_FPS_INDEX.get(int(self.fps), 1)] * x0.shape[0],
        }
        return Prepared(inputs, obj.flow_target(x0, noise), mask=weights)

    def predict(self, denoiser: torch.nn.Module, prepared: Prepared) -> torch.Tensor:
        """``df`` with a frame-rate embedding: one clip a forward. diffusers 0.42.1's transformer adds that
        embedding to per-frame timesteps correctly for a batch of one clip only (as the pipeline runs it);
        clips do not interact in the forward, so the batch's output is the clips' outputs stacked."""
        inputs = prepared.inputs
        if self.variant not in DF or len(inputs["fps"]) == 1 or not common.unwrap(denoiser).config.get(
            "inject_sample_info"
        ):
            return super().predict(denoiser, prepared)
        outs = [denoiser(**{k: v[i : i + 1] if isinstance(v, torch.Tensor | list) else v for k, v in inputs.items()},
                         return_dict=False)[0] for i in range(len(inputs["fps"]))]
        return torch.cat(outs)

    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        if self.variant in DF:
            raise ValueError(f"skyreels-v2 {self.variant}: pipeline parallelism is not implemented (per-frame timesteps); set "
                             "train.pipeline_stages: 1")
        return super().pipeline_layers(denoiser)

    def sample_kwargs(self, cfg) -> dict[str, Any]:
        if self.variant == "df-v2v" and not cfg.videos:
            raise ValueError("sample.videos: SkyReels V2 df-v2v samples continue a clip; give one per sample.prompts")
        out = super().sample_kwargs(cfg)
        if self.variant in DF:
            out["fps"] = int(self.fps)
        if self.variant == "df-v2v":  # one window: the prefix (the input's last frames) and what follows it
            if out["num_frames"] <= self.prefix_frames:
                raise ValueError(f"sample.frames {cfg.frames}: SkyReels V2 df-v2v samples hold the "
                                 f"{self.prefix_frames} prefix frames (model.prefix_frames) and new ones after them; "
                                 f"give more than {self.prefix_frames}")
            out.update(overlap_history=self.prefix_frames, base_num_frames=out["num_frames"])
        return out
