"""Family ``hidream``: HiDream-I1 (Full / Dev / Fast)."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, Kohya

SPEC = FamilySpec(
    model="HiDream-I1 (Full / Dev / Fast)",
    tasks="text-to-image",
    targets="attention of both streams, the MoE's shared expert",
    kohya=Kohya("hidream", "hidream-i1/lora", "https://github.com/HiDream-ai/HiDream-I1"),
    comfyui_readers="ComfyUI, `HiDreamImagePipeline.load_lora_weights`",
    kohya_readers="ComfyUI",
    comfy_reads_diffusers="all",
)
