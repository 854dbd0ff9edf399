"""Family ``cogvideox``: CogVideoX 2B / 5B."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, SampleDefaults

SPEC = FamilySpec(
    model="CogVideoX 2B / 5B",
    tasks="text-to-video; 8 fps, 4k+1 frames (1.5: 8k+5)",
    targets="`attn1.to_q/k/v/out.0`, `ff.net.0.proj`, `ff.net.2`",
    comfyui_readers="ComfyUI (its own CogVideoX model's names: `blocks.N.q/k/v/attn_out`, `ff_proj`/`ff_out`, `time_embedding_linear_1`); diffusers has no reader: use the diffusers file",
    kohya_readers="ComfyUI",
    sampling={
        None: SampleDefaults(50, 6.0),
    },
)
