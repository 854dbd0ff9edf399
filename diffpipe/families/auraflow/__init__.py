"""Family ``auraflow``: AuraFlow (MMDiT + single DiT blocks, flow matching, UMT5 text)."""

from __future__ import annotations

from diffpipe.families.auraflow.flavors import PUBLISHED
from diffpipe.models.spec import Absent, FamilySpec, diffusers_files_only

_NO_REFERENCE = "not checked against an independent reference of AuraFlow's original checkpoint names yet"

SPEC = FamilySpec(
    name="auraflow",
    family_class="AuraFlowFamily",
    model="AuraFlow v0.1-0.3",
    tasks="text-to-image (flow matching)",
    targets="attention of both streams, the feed-forwards of both block kinds",
    published=tuple(PUBLISHED),
    **diffusers_files_only(_NO_REFERENCE),
    layers=Absent("not implemented yet"),
)
