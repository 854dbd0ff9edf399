"""Family ``sd3``: SD 3 / 3.5 (`objective.weighting_scheme`)."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, SampleDefaults

SPEC = FamilySpec(
    model="SD 3 / 3.5 (`objective.weighting_scheme`)",
    tasks="text-to-image",
    targets="joint attention of both streams, both feed-forwards",
    comfyui_readers="ComfyUI (MMDiT names, fused `qkv`)",
    kohya_readers="ComfyUI (sd-scripts names); diffusers has no reader for either: use the diffusers file",
    comfy_reads_diffusers="all",
    sampling={
        None: SampleDefaults(28, 7.0),
    },
)
