"""Family ``lumina2``: Lumina Image 2.0."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, Kohya

SPEC = FamilySpec(
    model="Lumina Image 2.0",
    tasks="text-to-image",
    targets="attention, SwiGLU `feed_forward.linear_1/2/3`",
    kohya=Kohya("lumina2", "lumina-2/lora", "https://github.com/Alpha-VLLM/Lumina-Image-2.0"),
    comfyui_readers="ComfyUI; `Lumina2Pipeline.load_lora_weights` only when every block layer incl. `norm1.linear` is trained",
    kohya_readers="ComfyUI (sd-scripts names)",
    comfy_reads_diffusers="none",
)
