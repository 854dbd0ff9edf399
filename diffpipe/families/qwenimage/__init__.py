"""Family ``qwenimage``: Qwen-Image."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, Kohya

SPEC = FamilySpec(
    model="Qwen-Image",
    tasks="text-to-image",
    targets="joint attention of both streams, image MLP",
    kohya=Kohya("qwen_image", "Qwen-Image/lora", "https://github.com/QwenLM/Qwen-Image"),
    comfyui_readers="ComfyUI, `QwenImagePipeline.load_lora_weights`",
    kohya_readers="ComfyUI, musubi-tuner names, `QwenImagePipeline.load_lora_weights`",
    comfy_reads_diffusers="all",
)
