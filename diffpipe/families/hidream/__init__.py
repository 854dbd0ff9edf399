"""Family ``hidream``: HiDream-I1 (Full / Dev / Fast)."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, SampleDefaults

SPEC = FamilySpec(
    model="HiDream-I1 (Full / Dev / Fast)",
    tasks="text-to-image",
    targets="attention of both streams, the MoE's shared expert",
    comfyui_readers="ComfyUI, `HiDreamImagePipeline.load_lora_weights`",
    kohya_readers="ComfyUI",
    comfy_reads_diffusers="all",
    sampling={
        None: SampleDefaults(50, 5.0),
    },
)
