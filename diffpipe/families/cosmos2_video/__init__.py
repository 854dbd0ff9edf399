"""Family ``cosmos2-video``: Cosmos-Predict2 Video2World 2B / 14B."""

from __future__ import annotations

from diffpipe.models.spec import Absent, FamilySpec, SampleDefaults

SPEC = FamilySpec(
    model="Cosmos-Predict2 Video2World 2B / 14B",
    tasks="image/video-to-video: the clip's first 1 or 2 latent frames condition the rest (no control image needed); 16 fps, 4k+1 frames; samples need `sample.images`",
    targets="as `cosmos2`",
    comfyui_readers="ComfyUI (Cosmos-Predict2 names without `net.`); diffusers has no reader: use the diffusers file",
    kohya_readers="ComfyUI",
    layers=Absent("not implemented yet: the layers would have to carry the per-frame timestep and condition mask"),
    sampling={
        None: SampleDefaults(35, 7.0),
    },
)
