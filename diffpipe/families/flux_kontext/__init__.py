"""Family ``flux-kontext``: FLUX.1 Kontext."""

from __future__ import annotations

from diffpipe.models.spec import Absent, FamilySpec, SampleDefaults

SPEC = FamilySpec(
    model="FLUX.1 Kontext",
    tasks="image editing (a control image per item)",
    targets="as `flux`",
    comfyui_readers="ComfyUI (Flux names, fused `qkv`/`linear1`), `FluxKontextPipeline.load_lora_weights`",
    kohya_readers="ComfyUI, `FluxKontextPipeline.load_lora_weights`",
    comfy_reads_diffusers="all",
    a1111=True,
    layers=Absent("not implemented yet"),
    sampling={
        None: SampleDefaults(28, 3.5),
    },
)
