"""Family ``ernie-image``: ERNIE-Image (and Turbo)."""

from __future__ import annotations

from diffpipe.families.ernie_image.flavors import PUBLISHED
from diffpipe.models.spec import FamilySpec, diffusers_files_only

_NO_REFERENCE = "not checked against an independent reference of ERNIE-Image's original checkpoint names yet"

SPEC = FamilySpec(
    name="ernie-image",
    family_class="ErnieImageFamily",
    model="ERNIE-Image, ERNIE-Image-Turbo",
    tasks="text-to-image (flow matching; Mistral 3 text, one token stream for image and text, FLUX.2's VAE)",
    targets="attention `self_attention.to_q/k/v/out.0`, gated feed-forward `mlp.gate_proj/up_proj/linear_fc2`",
    published=tuple(PUBLISHED),
    **diffusers_files_only(_NO_REFERENCE),
)
