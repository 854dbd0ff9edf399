"""Family ``mochi``: Mochi 1 preview."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, SampleDefaults

SPEC = FamilySpec(
    model="Mochi 1 preview",
    tasks="text-to-video; 30 fps, 6k+1 frames",
    targets="attention of both streams, both feed-forwards",
    comfyui_readers="ComfyUI (fused `qkv_x`/`qkv_y`); diffusers has no reader: use the diffusers file",
    kohya_readers="ComfyUI",
    sampling={
        None: SampleDefaults(64, 4.5),
    },
)
