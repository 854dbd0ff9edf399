"""Family ``krea2``: Krea 2 (Base, Turbo)."""

from __future__ import annotations

from diffpipe.families.krea2.flavors import PUBLISHED
from diffpipe.models.spec import FamilySpec, diffusers_files_only

_NO_REFERENCE = "not checked against an independent reference of Krea 2's original checkpoint names yet"

SPEC = FamilySpec(
    name="krea2",
    family_class="Krea2Family",
    model="Krea 2 Base, Krea 2 Turbo",
    tasks="text-to-image (flow matching; Qwen3-VL text at 12 layers, fused inside the transformer)",
    targets="attention `attn.to_q/k/v/out.0`, its `to_gate`, SwiGLU `ff.gate/up/down` (text-fusion blocks included)",
    published=tuple(PUBLISHED),
    **diffusers_files_only(_NO_REFERENCE),
)
