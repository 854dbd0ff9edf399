"""Family ``ideogram4``: Ideogram 4."""

from __future__ import annotations

from diffpipe.families.ideogram4.flavors import PUBLISHED
from diffpipe.models.spec import FamilySpec, diffusers_files_only

SPEC = FamilySpec(
    name="ideogram4",
    family_class="Ideogram4Family",
    model="Ideogram 4",
    tasks="text-to-image (flow matching; Qwen3-VL text at 13 layers, one packed text + image sequence; the "
          "unconditional transformer of its guidance is loaded for samples, not trained)",
    targets="attention `attention.to_q/k/v/out.0`, SwiGLU `feed_forward.w1/w2/w3`",
    published=tuple(PUBLISHED),
    **diffusers_files_only("not written yet: the original checkpoint fuses `attention.qkv` (its names are known "
                           "from diffusers' Ideogram 4 LoRA converter), but no key map is written for it yet"),
)
