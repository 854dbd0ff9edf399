"""Wan image-to-video (``model.variant: 2.1-i2v``, ``2.1-flf2v``, ``2.2-i2v-a14b``, ``2.2-5b-i2v``): the
conditioning the ``wan`` family caches and feeds.

Wan 2.2 TI2V-5B (``expand_timesteps``) conditions differently: its first
latent frame *is* the image's clean latents, at timestep 0 on its tokens
(:func:`noisy_frames`, :func:`first_frame_timesteps`). The rest of this
module is the 36-channel models' conditioning.

``WanImageToVideoPipeline`` conditions every step on the first frame (and,
first-and-last-frame models, on a last frame: ``last_image``) twice:

- ``condition``: the VAE latents (normalised) of the first frame followed by
  black frames (and the last frame), behind 4 mask channels that mark the
  given frames; the transformer (36 input channels) reads
  ``cat([noisy latents (16), mask (4), condition latents (16)])``;
- ``image_embeds``: the CLIP vision encoder's penultimate hidden states of
  the image (of both images, FLF2V, whose image embedder adds a position
  embedding over the pair), attended to by every block's extra image
  key/value projections.

The cache stores the condition latents as the item's ``control`` and the CLIP
hidden states as its ``control_embeds``; the mask is a function of the latent
shape, built at training time. The functions below are the pipeline's
construction, written once for both the cache and the loss.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

from diffpipe.models import _common as common
from diffpipe.utils import digest

#: Tiny CLIP vision tower (17 tokens: 16 patches of a 32x32 image + the class token).
TINY_CLIP_VISION = {
    "hidden_size": 32,
    "intermediate_size": 37,
    "num_attention_heads": 4,
    "num_hidden_layers": 3,
    "image_size": 32,
    "patch_size": 8,
    "projection_dim": 32,
}
#: Its hidden states' length per image.
TINY_CLIP_TOKENS = (TINY_CLIP_VISION["image_size"] // TINY_CLIP_VISION["patch_size"]) ** 2 + 1
CLIP_TOKENS = 257  # Wan 2.1 I2V's CLIP vision states per image (ViT-H/14 at 224 px: 16 x 16 patches + class)


def tiny_image_encoder(seed: int, prefix: str) -> tuple[CLIPVisionModel, CLIPImageProcessor]:
    """The tiny flavor's CLIP vision encoder (random weights) and its processor (built offline)."""
    side = TINY_CLIP_VISION["image_size"]
    processor = CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    with common.seeded(seed, f"{prefix}.image_encoder"):
        return CLIPVisionModel(CLIPVisionConfig(**TINY_CLIP_VISION)).eval(), processor


def load_image_encoder(path: str | Path, variant: str | None = None) -> tuple[CLIPVisionModel, CLIPImageProcessor]:
    """A diffusers folder's ``image_encoder`` (its ``variant`` weight files) and ``image_processor``."""
    encoder = CLIPVisionModel.from_pretrained(path, subfolder="image_encoder", variant=variant).eval()
    return encoder, CLIPImageProcessor.from_pretrained(path, subfolder="image_processor")


def image_encoder_identity(encoder: CLIPVisionModel, processor: CLIPImageProcessor) -> dict[str, Any]:
    return {"image_encoder": common.module_identity(encoder), "image_processor": processor.to_dict()}


def folder_image_encoder_identity(path: str | Path, variant: str | None = None) -> dict[str, Any]:
    """Like :func:`image_encoder_identity`, from a folder without loading the weights."""
    return {
        "image_encoder": common.transformers_folder_identity(
            CLIPVisionModel, CLIPVisionConfig, str(path), "image_encoder", variant=variant,
        ),
        "image_processor": CLIPImageProcessor.from_pretrained(path, subfolder="image_processor").to_dict(),
    }


def latent_identity(family: Any) -> str:
    """The latent cache's identity for Wan 2.1 I2V: its VAE and the image encoder that embeds controls."""
    cfg = family.cfg
    if cfg.flavor == "tiny":
        return common.memo_identity(
            (family.name, family.variant, cfg.seed, "vae"),
            lambda: digest(
                {
                    "vae": common.module_identity(family.load_vae()),
                    **image_encoder_identity(*family.load_image_encoder()),
                }
            ),
        )
    return digest(
        {
            "vae": common.diffusers_component_identity(family.vae_class, cfg, "vae"),
            **folder_image_encoder_identity(cfg.path, cfg.weight_variant),
        }
    )


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    """``[B, 3, 1, H, W]`` (or ``[B, 3, H, W]``) in [-1, 1] -> RGB images (exact for cached 8-bit pixels)."""
    if images.ndim == 5:
        images = images[:, :, 0]
    arr = ((images.detach().float().cpu() + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return [Image.fromarray(np.ascontiguousarray(a.permute(1, 2, 0).numpy())) for a in arr]


def embed_images(encoder: CLIPVisionModel, processor: CLIPImageProcessor, images: list[Image.Image]) -> torch.Tensor:
    """``WanImageToVideoPipeline.encode_image``: the penultimate hidden states ``[B, tokens, dim]``."""
    param = next(encoder.parameters())
    inputs = processor(images=images, return_tensors="pt").to(param.device)
    with torch.no_grad():
        out = encoder(pixel_values=inputs["pixel_values"].to(param.dtype), output_hidden_states=True)
    return out.hidden_states[-2].float()


def condition_video(control: torch.Tensor, frames: int) -> torch.Tensor:
    """The pixels the pipeline encodes, from a control ``[B,3,1,H,W]`` (first frame) or ``[B,3,2,H,W]``
    (first and last frame: ``last_image``): the first frame, black (zero) frames, the last frame.

    A one-frame clip's first and last frames are the frame itself (the pipeline's mask marks it either way).
    """
    b, c, n, h, w = control.shape
    if n == 1 or frames == 1:
        return torch.cat([control[:, :, :1], control.new_zeros(b, c, frames - 1, h, w)], dim=2)
    return torch.cat([control[:, :, :1], control.new_zeros(b, c, frames - 2, h, w), control[:, :, 1:]], dim=2)


def frame_mask(control: torch.Tensor, temporal: int, *, last: bool = False) -> torch.Tensor:
    """The pipeline's mask channels for condition latents ``[B,C,F',h,w]``: ``[B, temporal, F', h, w]``.

    ``prepare_latents`` marks pixel frame 0 (and, with ``last_image``, the last
    pixel frame), repeats frame 0 ``temporal`` times and folds the pixel frames
    into ``temporal`` channels per latent frame: ones on latent frame 0; with
    ``last``, also on the last latent frame's final channel.
    """
    b, _, f, h, w = control.shape
    mask = control.new_zeros(b, temporal, f, h, w)
    mask[:, :, 0] = 1
    if last and f > 1:
        mask[:, temporal - 1, f - 1] = 1
    return mask


def transformer_input(noisy: torch.Tensor, control: torch.Tensor, temporal: int, *, last: bool = False) -> torch.Tensor:
    """``cat([latents, condition])`` with ``condition = cat([mask, condition latents])``, as the pipeline calls it."""
    condition = torch.cat([frame_mask(control, temporal, last=last), control.to(noisy)], dim=1)
    return torch.cat([noisy, condition.to(noisy)], dim=1)


def embed_controls(encoder: CLIPVisionModel, processor: CLIPImageProcessor, control: torch.Tensor) -> torch.Tensor:
    """Each control's CLIP hidden states: ``[B, tokens, dim]`` for one frame; ``[B, 2, tokens, dim]`` for a first
    and a last frame, embedded together as the pipeline's ``encode_image([image, last_image])`` does."""
    b, _, n = control.shape[:3]
    frames = [to_pil(control[:, :, k]) for k in range(n)]
    embeds = embed_images(encoder, processor, [img for row in zip(*frames, strict=True) for img in row])
    return embeds if n == 1 else embeds.view(b, n, *embeds.shape[1:])


def image_states(control_embeds: torch.Tensor) -> torch.Tensor:
    """Cached ``control_embeds`` -> the transformer's ``encoder_hidden_states_image``: a first-and-last pair
    ``[B, 2, tokens, dim]`` becomes ``[2B, tokens, dim]``, the layout its image embedder folds back in pairs."""
    return control_embeds.flatten(0, 1) if control_embeds.ndim == 4 else control_embeds


def noisy_frames(x0: torch.Tensor) -> torch.Tensor:
    """Wan 2.2 TI2V-5B's ``first_frame_mask`` for latents ``[B,C,F',h,w]``: ``[B,1,F',h,w]``, 0 on the first latent
    frame (the image's clean latents) and 1 on the frames denoised."""
    keep = torch.ones_like(x0[:, :1])
    keep[:, :, 0] = 0
    return keep


def first_frame_timesteps(timestep: torch.Tensor, frames: int, per_frame: int) -> torch.Tensor:
    """``[B]`` timesteps -> ``[B, frames x per_frame]`` per token, 0 on the first frame's tokens: the TI2V-5B
    pipeline's ``first_frame_mask[0][0][:, ::2, ::2] * t`` flattened."""
    t = timestep[:, None].expand(timestep.shape[0], frames * per_frame).clone()
    t[:, :per_frame] = 0
    return t


def check_control_frames(given: int, *, last: bool, model: str) -> None:
    """A clear error unless the cached control holds the frames the model conditions on (one, or a first and a
    last)."""
    if given != (2 if last else 1):
        raise ValueError(
            f"{model} conditions on {'a first and a last frame' if last else 'one image'}"
            f", got {given} control frame(s): datasets[].control_from_last_frame must be "
            f"{str(last).lower()}"
        )


def missing_control(variant: str, *, last: bool) -> ValueError:
    """The error for a batch without the control an image-conditioned variant trains on."""
    return ValueError(
        f"model.variant {variant} needs a control image per item (its conditioning first frame): set "
        "datasets[].control_path / control_column, or control_from_first_frame: true"
        + (" (and control_from_last_frame: true)" if last else "")
    )


def condition(noisy: torch.Tensor, x0: torch.Tensor, control: torch.Tensor, weights: torch.Tensor | None, *,
              first_clean: bool, temporal: int, last: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The transformer's input latents and the loss weights, conditioned on the cached ``control`` as the
    pipeline does: TI2V-5B (``first_clean``) puts the clean first frame in place of the noisy one and leaves
    it out of the loss (nothing to learn there); the 36-channel models read the mask and condition latents
    beside the noisy ones."""
    if first_clean:
        keep = noisy_frames(x0)
        noisy = (1 - keep) * control.to(x0.device).float() + keep * noisy
        return noisy, keep.expand(x0.shape) * (1 if weights is None else weights)
    return transformer_input(noisy, control.to(x0.device).float(), temporal, last=last), weights


def estimate_embeds(latents: torch.Tensor, config: Any) -> torch.Tensor | None:
    """Zero CLIP states of an image embedder's width (None: the transformer has none): 257 tokens (CLIP ViT-H/14
    at 224 px) a frame, or the pair its position embedding covers (FLF2V)."""
    if not config.get("image_dim"):
        return None
    pairs = config.get("pos_embed_seq_len")
    shape = (2, pairs // 2) if pairs else (CLIP_TOKENS,)
    return latents.new_zeros(latents.shape[0], *shape, config["image_dim"])


def check_sample_images(images: Any, last_images: Any, *, first: bool, last: bool, model: str) -> None:
    """A clear error unless ``sample`` gives the images an image-to-video model starts (``first``) and, FLF2V
    (``last``), ends on."""
    if first and not images:
        raise ValueError(f"sample.images: {model} (image-to-video) samples start from an image; "
                         "give one per sample.prompts")
    if last and not last_images:
        raise ValueError(f"sample.last_images: {model} samples end on a given last frame; give one "
                         "per sample.prompts")
