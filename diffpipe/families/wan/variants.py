"""The versions family ``wan`` covers (``model.variant``; a local folder's is read from it): what tells
one from another, their tiny flavors, and how a diffusers folder says which it holds.

- ``2.1``: Wan 2.1 T2V (16-channel VAE, 8x spatial).
- ``2.2-5b``: Wan 2.2 TI2V-5B used text-to-video: the 48-channel VAE with 16x
  spatial compression (2x2 patchified inside the VAE) and ``expand_timesteps``:
  the transformer gets one timestep per latent token (``[B, seq]``).
- ``2.2-5b-i2v``: Wan 2.2 TI2V-5B's image-conditioned mode (the same
  weights; a TI2V-5B folder is accepted): each item's control image (its
  first frame) is cached as its one-frame latents; the transformer gets them
  as the clean first latent frame with timestep 0 on its tokens, as
  ``WanImageToVideoPipeline`` with ``expand_timesteps`` does, and the loss
  leaves that frame out (the pipeline keeps the image's latents there).
  One-frame items (images) therefore add no loss in this mode.
- ``2.2-a14b``: Wan 2.2 T2V-A14B, two experts: ``transformer`` denoises while
  the scheduler timestep is at or above ``boundary_ratio x 1000`` (high
  noise), ``transformer_2`` below it (low noise). ``model.expert`` picks the
  one trained (``high`` or ``low``); its timesteps are drawn only from its
  own range, so the LoRA learns exactly what the pipeline will ask of it.
  The LoRA file keeps diffusers' ``transformer.`` keys either way; the low
  expert's loads with ``pipe.load_lora_weights(file, load_into_transformer_2=True)``.
  ``both`` trains a LoRA on each in one run (:mod:`diffpipe.families.wan.experts`):
  timesteps are drawn over the whole schedule and each sample goes to the
  expert the pipeline would use at its timestep; export writes the low
  expert's LoRA beside the high one's with a ``_low_noise`` suffix.
- ``2.2-i2v-a14b``: Wan 2.2 I2V-A14B: the two experts of ``2.2-a14b``
  (boundary 0.9) conditioned on a first frame as ``2.1-i2v`` is, through the
  condition latents alone: no image encoder, no image key/value projections
  (``WanImageToVideoPipeline`` passes no image embedding when the transformer
  has no ``image_dim``). ``model.expert`` as for ``2.2-a14b``.
- ``2.1-flf2v``: Wan 2.1 FLF2V (first and last frame to video): ``2.1-i2v``'s
  conditioning from two frames, as ``WanImageToVideoPipeline(image=..., last_image=...)``
  builds it: the condition latents hold the first frame, black frames and the
  last frame, the mask marks both, and the image embedder reads both frames'
  CLIP states with its position embedding over the pair. Each item's control
  is its first frame (a control image or ``control_from_first_frame``) and
  its own last frame (``datasets[].control_from_last_frame``, required).
- ``2.1-i2v``: Wan 2.1 I2V in ``WanImageToVideoPipeline``: each item's control
  image (a control image, or its own first frame with
  ``datasets[].control_from_first_frame``) is cached as the VAE latents of
  that frame followed by black frames (``control``) and its CLIP vision
  embedding (``control_embeds``); the loss feeds the 36-channel transformer
  exactly what the pipeline builds (:mod:`diffpipe.families.wan.i2v`). Its
  transformer splits the text off the image tokens at 512, so the tiny
  flavor's prompts are 512 tokens long too.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffusers import AutoencoderKLWan, WanTransformer3DModel

from diffpipe.families.wan import i2v as wan_i2v
from diffpipe.families.wan.flavors import TINY_LENGTH, TINY_TRANSFORMER, TINY_VAE, TINY_VAE_22

MAX_LENGTH = 512  # WanPipeline's default max_sequence_length
DEFAULT_BOUNDARY = 0.875  # Wan 2.2 T2V-A14B's boundary_ratio
I2V_BOUNDARY = 0.9  # Wan 2.2 I2V-A14B's


@dataclass(frozen=True)
class WanVariant:
    """What tells one Wan version from another, and its tiny flavor."""

    vae: dict[str, Any]
    transformer: dict[str, Any]
    #: The published scheduler's flow shift (the tiny flavor's scheduler uses it).
    flow_shift: float
    #: One timestep per latent token (Wan 2.2 TI2V-5B).
    expand_timesteps: bool = False
    #: Two experts split at this fraction of the schedule (Wan 2.2 A14B); None: one transformer.
    boundary_ratio: float | None = None
    seed_prefix: str = "wan"
    #: Conditioned on a first frame (its condition latents beside the noisy ones: Wan 2.1 and 2.2 I2V).
    image_to_video: bool = False
    #: ... and on its CLIP vision embedding (Wan 2.1 I2V; Wan 2.2 I2V-A14B has no image encoder).
    image_embeds: bool = False
    #: ... and on a last frame too (Wan 2.1 FLF2V: ``last_image``).
    last_frame: bool = False
    #: The tiny flavor's prompt length.
    text_length: int = TINY_LENGTH
    #: Another variant whose weights this one trains in another mode (a folder detected as it is accepted).
    weights_of: str | None = None


_TI2V_5B = WanVariant(
    TINY_VAE_22,
    {**TINY_TRANSFORMER, "in_channels": 48, "out_channels": 48},
    5.0,
    expand_timesteps=True,
    seed_prefix="wan2.2-5b",
)

VARIANTS: dict[str, WanVariant] = {
    "2.1": WanVariant(TINY_VAE, TINY_TRANSFORMER, 3.0),
    "2.2-5b": _TI2V_5B,
    # TI2V-5B's image-conditioned mode: the first latent frame is the image's clean latents at timestep 0.
    "2.2-5b-i2v": dataclasses.replace(_TI2V_5B, image_to_video=True, weights_of="2.2-5b"),
    "2.2-a14b": WanVariant(
        TINY_VAE, TINY_TRANSFORMER, 12.0, boundary_ratio=DEFAULT_BOUNDARY, seed_prefix="wan2.2-a14b"
    ),
    # 16 noisy + 4 mask + 16 condition channels in; image tokens through extra key/value projections.
    "2.1-i2v": WanVariant(
        TINY_VAE,
        {
            **TINY_TRANSFORMER,
            "in_channels": 36,
            "image_dim": wan_i2v.TINY_CLIP_VISION["hidden_size"],
            "added_kv_proj_dim": TINY_TRANSFORMER["num_attention_heads"] * TINY_TRANSFORMER["attention_head_dim"],
        },
        3.0,
        seed_prefix="wan2.1-i2v",
        image_to_video=True,
        image_embeds=True,
        text_length=MAX_LENGTH,
    ),
    # 2.1-i2v's transformer whose image embedder takes the first and last frames' CLIP states, with a
    # position embedding over the pair (two tiny CLIP sequences of 17 tokens).
    "2.1-flf2v": WanVariant(
        TINY_VAE,
        {
            **TINY_TRANSFORMER,
            "in_channels": 36,
            "image_dim": wan_i2v.TINY_CLIP_VISION["hidden_size"],
            "added_kv_proj_dim": TINY_TRANSFORMER["num_attention_heads"] * TINY_TRANSFORMER["attention_head_dim"],
            "pos_embed_seq_len": 2 * wan_i2v.TINY_CLIP_TOKENS,
        },
        5.0,
        seed_prefix="wan2.1-flf2v",
        image_to_video=True,
        image_embeds=True,
        last_frame=True,
        text_length=MAX_LENGTH,
    ),
    # 16 noisy + 4 mask + 16 condition channels in, no image embedder; two experts.
    "2.2-i2v-a14b": WanVariant(
        TINY_VAE,
        {**TINY_TRANSFORMER, "in_channels": 36},
        5.0,
        boundary_ratio=I2V_BOUNDARY,
        seed_prefix="wan2.2-i2v-a14b",
        image_to_video=True,
    ),
}
#: What a variant's transformer is conditioned on (``WanFamily.sizes``).
CONDITIONING = ("image_to_video", "image_embeds", "last_frame", "expand_timesteps")
#: The variants with two experts (``model.expert``).
EXPERT_VARIANTS = tuple(name for name, v in VARIANTS.items() if v.boundary_ratio is not None)


def detect_variant(path: str | Path) -> str:
    """The Wan version of a diffusers folder: a ``transformer_2`` means A14B (I2V when its transformer
    reads 36 channels), an ``image_encoder`` 2.1 I2V (FLF2V when the image embedder has a position
    embedding over two images), a 48-channel VAE TI2V-5B."""
    path = Path(path)
    index_file = path / "model_index.json"
    index = json.loads(index_file.read_text()) if index_file.is_file() else {}
    second = index.get("transformer_2")
    if (isinstance(second, list) and second and second[0]) or (path / "transformer_2" / "config.json").is_file():
        channels = WanTransformer3DModel.load_config(path, subfolder="transformer").get("in_channels")
        return "2.2-i2v-a14b" if channels == 36 else "2.2-a14b"
    encoder = index.get("image_encoder")
    if (isinstance(encoder, list) and encoder and encoder[0]) or (path / "image_encoder" / "config.json").is_file():
        pairs = WanTransformer3DModel.load_config(path, subfolder="transformer").get("pos_embed_seq_len")
        return "2.1-flf2v" if pairs else "2.1-i2v"
    if index.get("expand_timesteps") or AutoencoderKLWan.load_config(path, subfolder="vae").get("z_dim") == 48:
        return "2.2-5b"
    return "2.1"

