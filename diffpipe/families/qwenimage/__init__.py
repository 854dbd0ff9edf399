"""Family ``qwenimage``: Qwen-Image."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, SampleDefaults

SPEC = FamilySpec(
    model="Qwen-Image",
    tasks="text-to-image",
    targets="joint attention of both streams, image MLP",
    comfyui_readers="ComfyUI, `QwenImagePipeline.load_lora_weights`",
    kohya_readers="ComfyUI, musubi-tuner names, `QwenImagePipeline.load_lora_weights`",
    comfy_reads_diffusers="all",
    sampling={
        None: SampleDefaults(50, 4.0),
    },
)
