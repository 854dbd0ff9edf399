"""Family ``sana``: Sana (linear-attention DiT, deep-compression autoencoder, Gemma-2 text)."""

from __future__ import annotations

from diffpipe.families.sana.flavors import PUBLISHED
from diffpipe.models.spec import Absent, FamilySpec

_NO_REFERENCE = "not checked against an independent reference of Sana's original checkpoint names yet"

SPEC = FamilySpec(
    name="sana",
    family_class="SanaFamily",
    model="Sana 1.6B / 600M",
    tasks="text-to-image (flow matching; DC-AE latents, 32x compression)",
    targets="self and cross attention `attn1/attn2.to_q/k/v/out.0`, the Mix-FFN 1x1 convolutions `ff.conv_inverted`, `ff.conv_point`",
    published=tuple(PUBLISHED),
    kohya=Absent(_NO_REFERENCE),
    comfyui_readers="-",
    kohya_readers="-",
    comfy_reads_diffusers="none",
    layers=Absent("not implemented yet"),
    keymap=Absent(_NO_REFERENCE),
)
