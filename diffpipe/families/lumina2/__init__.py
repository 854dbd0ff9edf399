"""Family ``lumina2``: Lumina Image 2.0."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, SampleDefaults

SPEC = FamilySpec(
    model="Lumina Image 2.0",
    tasks="text-to-image",
    targets="attention, SwiGLU `feed_forward.linear_1/2/3`",
    comfyui_readers="ComfyUI; `Lumina2Pipeline.load_lora_weights` only when every block layer incl. `norm1.linear` is trained",
    kohya_readers="ComfyUI (sd-scripts names)",
    sampling={
        None: SampleDefaults(30, 4.0),
    },
)
