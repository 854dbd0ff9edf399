"""Key map of family ``skyreels-v2``: Wan's (``diffpipe.families.wan.keymap``), for SkyReels V2's transformer.

``SkyReelsV2Transformer3DModel`` has ``WanTransformer3DModel``'s module names and shapes, its original
checkpoints Wan's layer names, and diffusers reads its LoRAs with Wan's converters; ComfyUI runs it as
a Wan model.
"""

from __future__ import annotations

from diffusers import SkyReelsV2Transformer3DModel

from diffpipe.families.wan.keymap import build  # noqa: F401  (the table is Wan's)
from diffpipe.models.spec import Kohya

DENOISER = SkyReelsV2Transformer3DModel
KOHYA = Kohya("wan", "wan2.1/lora", "https://github.com/SkyworkAI/SkyReels-V2")
