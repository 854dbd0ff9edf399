"""Family ``cosmos2``: Cosmos-Predict2 2B / 14B."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, SampleDefaults

SPEC = FamilySpec(
    model="Cosmos-Predict2 2B / 14B",
    tasks="text-to-image",
    targets="self and cross attention `attn1/attn2.to_q/k/v/out.0`, `ff.net.0.proj`, `ff.net.2`",
    comfyui_readers="ComfyUI (Cosmos-Predict2 names without `net.`); diffusers has no reader: use the diffusers file",
    kohya_readers="ComfyUI",
    sampling={
        None: SampleDefaults(35, 7.0),
    },
)
