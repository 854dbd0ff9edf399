"""Family ``auraflow``: AuraFlow (MMDiT + single DiT blocks, flow matching, UMT5 text)."""

from __future__ import annotations

from diffpipe.models.spec import Absent, FamilySpec, Kohya, generic_comfy_names

SPEC = FamilySpec(
    model="AuraFlow v0.1-0.3",
    tasks="text-to-image (flow matching)",
    targets="attention of both streams, the feed-forwards of both block kinds",
    # No kohya-family trainer names it: the metadata says what the file is in the same scheme.
    **generic_comfy_names(Kohya("auraflow", "auraflow/lora", "https://huggingface.co/fal/AuraFlow"),
                          "the original checkpoint's layer names: `double_layers.N.attn.w2q`, "
                          "`single_layers.N.mlp.c_fc1`, ..."),
    layers=Absent("not implemented yet"),
)
