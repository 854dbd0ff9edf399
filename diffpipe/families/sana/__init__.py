"""Family ``sana``: Sana (linear-attention DiT, deep-compression autoencoder, Gemma-2 text)."""

from __future__ import annotations

from diffpipe.families.sana.flavors import PUBLISHED
from diffpipe.models.spec import Absent, FamilySpec, diffusers_files_only

_NO_REFERENCE = "not checked against an independent reference of Sana's original checkpoint names yet"

SPEC = FamilySpec(
    name="sana",
    family_class="SanaFamily",
    model="Sana 1.6B / 600M",
    tasks="text-to-image (flow matching; DC-AE latents, 32x compression)",
    targets="self and cross attention `attn1/attn2.to_q/k/v/out.0`, the Mix-FFN 1x1 convolutions `ff.conv_inverted`, `ff.conv_point`",
    published=tuple(PUBLISHED),
    **diffusers_files_only(_NO_REFERENCE),
    layers=Absent("not implemented yet"),
)
