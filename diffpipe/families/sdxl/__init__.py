"""Family ``sdxl``: SDXL 1.0 (size/crop conditioning from the bucket and crop used)."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, Kohya

SPEC = FamilySpec(
    model="SDXL 1.0 (size/crop conditioning from the bucket and crop used)",
    tasks="text-to-image",
    targets="as `sd`",
    kohya=Kohya("sdxl_base_v1-0", "stable-diffusion-xl-v1-base/lora", "https://github.com/Stability-AI/generative-models"),
    comfyui_readers="ComfyUI",
    kohya_readers="A1111/Forge, ComfyUI, `StableDiffusionXLPipeline.load_lora_weights` (SGM block names)",
    comfy_reads_diffusers="part",
    a1111=True,
    layers="diffpipe.families.sd.layers",
)
