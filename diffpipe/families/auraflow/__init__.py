"""Family ``auraflow``: AuraFlow (MMDiT + single DiT blocks, flow matching, UMT5 text)."""

from __future__ import annotations

from diffpipe.models.spec import Absent, FamilySpec, SampleDefaults, generic_comfy_names

SPEC = FamilySpec(
    model="AuraFlow v0.1-0.3",
    tasks="text-to-image (flow matching)",
    targets="attention of both streams, the feed-forwards of both block kinds",
    **generic_comfy_names("the original checkpoint's layer names: `double_layers.N.attn.w2q`, "
                          "`single_layers.N.mlp.c_fc1`, ..."),
    layers=Absent("not implemented yet"),
    sampling={
        None: SampleDefaults(50, 3.5),
    },
)
