"""Family ``skyreels-v2``: SkyReels V2 text-to-video (``SkyReelsV2Pipeline``), on Wan 2.1's parts.

SkyReels V2 is Wan 2.1's architecture trained further: the same UMT5 text encoder, causal 3-D VAE and
transformer layout (``SkyReelsV2Transformer3DModel`` has Wan's module names and weights' shapes, and
diffusers reads its LoRAs with Wan's converters), sampled at 24 fps with a UniPC flow shift of 8. So
the family is ``wan``'s with its own transformer class, pipeline and published sizes; Wan's key map,
pipeline layers and training inputs serve it unchanged. The diffusion-forcing and image-to-video
pipelines of SkyReels V2 are not this family.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from diffusers import SkyReelsV2Pipeline, SkyReelsV2Transformer3DModel

from diffpipe.families.wan.family import WanFamily, WanVariant
from diffpipe.families.wan.flavors import TINY_TRANSFORMER, TINY_VAE

#: One version: Wan 2.1's tiny parts, seeded apart; the T2V pipeline's flow shift.
VARIANTS = {"t2v": WanVariant(TINY_VAE, TINY_TRANSFORMER, 8.0, seed_prefix="skyreels-v2")}


class SkyReelsV2Family(WanFamily):
    name = "skyreels-v2"
    fps = 24.0
    variants: ClassVar[tuple[str, ...]] = ()
    variant_table = VARIANTS
    transformer_cls = SkyReelsV2Transformer3DModel
    pipeline_class = SkyReelsV2Pipeline
    extra_single_files = ()

    @staticmethod
    def detect_variant(path: str | Path) -> str | None:
        return None

    def load_pipeline(self) -> SkyReelsV2Pipeline:
        enc = self.load_text_encoders()
        return SkyReelsV2Pipeline(tokenizer=enc.tokenizer, text_encoder=enc.text_encoder,
                                  transformer=self._load_transformer("transformer"), vae=self.load_vae(),
                                  scheduler=self.inference_scheduler())
