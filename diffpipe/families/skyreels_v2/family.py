"""Family ``skyreels-v2``: SkyReels V2 text-to-video and image-to-video, on Wan 2.1's parts.

SkyReels V2 is Wan 2.1's architecture trained further: the same UMT5 text encoder, causal 3-D VAE and
transformer layout (``SkyReelsV2Transformer3DModel`` has Wan's module names and weights' shapes, and
diffusers reads its LoRAs with Wan's converters), sampled at 24 fps. So the family is ``wan``'s with its
own transformer class, pipelines and published sizes; Wan's key map, pipeline layers and training
inputs serve it unchanged.

Variants (``model.variant``; a local folder's is read from its transformer config):

- ``t2v`` (``SkyReelsV2Pipeline``, UniPC flow shift 8): text-to-video, as ``wan`` ``2.1``.
- ``i2v`` (``SkyReelsV2ImageToVideoPipeline``, flow shift 5): the 36-channel transformer with a CLIP
  image embedder, conditioned exactly as ``wan`` ``2.1-i2v`` (the pipeline's ``prepare_latents`` and
  ``encode_image`` are Wan 2.1 I2V's): each item's control image (or its own first frame,
  ``control_from_first_frame``) is cached as its condition latents and CLIP hidden states. The
  published folders name a ``CLIPVisionModelWithProjection`` and a ``CLIPProcessor``; the
  penultimate hidden states the pipeline reads are the vision tower's, which ``CLIPVisionModel`` and
  the processor's image part load from the same files.

The diffusion-forcing pipelines (per-frame timesteps, causal blocks) are not this family.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

from diffusers import SkyReelsV2ImageToVideoPipeline, SkyReelsV2Pipeline, SkyReelsV2Transformer3DModel

from diffpipe.families.wan.family import VARIANTS as WAN_VARIANTS
from diffpipe.families.wan.family import WanFamily, WanVariant
from diffpipe.families.wan.flavors import TINY_TRANSFORMER, TINY_VAE

#: The versions: Wan 2.1's tiny parts (T2V, and I2V's 36-channel transformer with its image embedder), seeded
#: apart; each pipeline's published flow shift.
VARIANTS = {
    "t2v": WanVariant(TINY_VAE, TINY_TRANSFORMER, 8.0, seed_prefix="skyreels-v2"),
    "i2v": dataclasses.replace(WAN_VARIANTS["2.1-i2v"], flow_shift=5.0, seed_prefix="skyreels-v2-i2v"),
}


class SkyReelsV2Family(WanFamily):
    name = "skyreels-v2"
    fps = 24.0
    variants: ClassVar[tuple[str, ...]] = tuple(VARIANTS)
    variant_table = VARIANTS
    transformer_cls = SkyReelsV2Transformer3DModel
    model_label = "SkyReels V2"
    extra_single_files = ()

    @staticmethod
    def detect_variant(path: str | Path) -> str | None:
        """``i2v`` where the transformer has an image embedder (``image_dim``), else ``t2v``."""
        if not (Path(path) / "transformer" / "config.json").is_file():
            return None
        config = SkyReelsV2Transformer3DModel.load_config(path, subfolder="transformer")
        return "i2v" if config.get("image_dim") else "t2v"

    @property
    def pipeline_class(self) -> type:
        return SkyReelsV2ImageToVideoPipeline if self.spec.image_to_video else SkyReelsV2Pipeline

    def load_pipeline(self) -> SkyReelsV2Pipeline | SkyReelsV2ImageToVideoPipeline:
        enc = self.load_text_encoders()
        parts = {"tokenizer": enc.tokenizer, "text_encoder": enc.text_encoder, "vae": self.load_vae(),
                 "transformer": self._load_transformer("transformer"), "scheduler": self.inference_scheduler()}
        if self.spec.image_embeds:
            parts["image_encoder"], parts["image_processor"] = self.load_image_encoder()
        return self.pipeline_class(**parts)
