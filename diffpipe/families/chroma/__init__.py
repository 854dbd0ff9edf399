"""Family ``chroma``: Chroma1-HD."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, SampleDefaults

SPEC = FamilySpec(
    model="Chroma1-HD",
    tasks="text-to-image",
    targets="as `flux`",
    comfyui_readers="ComfyUI, `ChromaPipeline.load_lora_weights` (not for a LoRA on `distilled_guidance_layer`, which diffusers' reader rejects)",
    kohya_readers="ComfyUI, `ChromaPipeline.load_lora_weights` (same limit)",
    comfy_reads_diffusers="all",
    sampling={
        None: SampleDefaults(35, 5.0),
    },
)
