"""Family ``zimage``: Z-Image (Turbo)."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, SampleDefaults

SPEC = FamilySpec(
    model="Z-Image (Turbo)",
    tasks="text-to-image (flow matching; Qwen3 text, one token stream for text and image)",
    targets="attention `attention.to_q/k/v/out.0`, SwiGLU `feed_forward.w1/w2/w3` (refiners included)",
    comfyui_readers="ComfyUI (maps `to_q/k/v` onto its fused `qkv`), `ZImagePipeline.load_lora_weights`",
    kohya_readers="`ZImagePipeline.load_lora_weights`",
    comfy_reads_diffusers="all",
    sampling={
        None: SampleDefaults(9, 0.0, model="Z-Image Turbo",
                             source="model card: Tongyi-MAI/Z-Image-Turbo, not checked here"),
    },
)
