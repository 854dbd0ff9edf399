"""Family ``sdxl``: SDXL 1.0 (size/crop conditioning from the bucket and crop used)."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, SampleDefaults

SPEC = FamilySpec(
    model="SDXL 1.0 (size/crop conditioning from the bucket and crop used)",
    tasks="text-to-image",
    targets="as `sd`",
    comfyui_readers="ComfyUI",
    kohya_readers="A1111/Forge, ComfyUI, `StableDiffusionXLPipeline.load_lora_weights` (SGM block names)",
    comfy_reads_diffusers="part",
    a1111=True,
    layers="diffpipe.families.sd.layers",
    sampling={
        None: SampleDefaults(50, 5.0),
    },
)
