"""Family ``flux``: FLUX.1 dev / schnell."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec

SPEC = FamilySpec(
    model="FLUX.1 dev / schnell",
    tasks="text-to-image",
    targets="attention of both streams, double-block feed-forwards",
    comfyui_readers="ComfyUI (fused `qkv`/`linear1`), `FluxPipeline.load_lora_weights`",
    kohya_readers="Forge, ComfyUI, `FluxPipeline.load_lora_weights`",
    comfy_reads_diffusers="all",
    a1111=True,
)
