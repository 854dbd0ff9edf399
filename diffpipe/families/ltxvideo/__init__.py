"""Family ``ltxvideo``: LTX-Video 0.9."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, SampleDefaults

SPEC = FamilySpec(
    model="LTX-Video 0.9",
    tasks="text-to-video; 25 fps, 8k+1 frames, sample sides multiples of 32",
    targets="`to_q/k/v/out.0`, `ff.net.0.proj`, `ff.net.2`",
    comfyui_readers="ComfyUI, `LTXPipeline.load_lora_weights` (except a LoRA on `proj_in`/`time_embed`, which diffusers' reader does not rename)",
    kohya_readers="ComfyUI",
    sampling={
        None: SampleDefaults(50, 3.0),
    },
)
