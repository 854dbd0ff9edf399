"""Family ``flux-control``: a control LoRA on FLUX.1 (depth, canny, ... conditioning by channel concatenation)."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, SampleDefaults, diffusers_files_only

_NO_REFERENCE = ("a control LoRA widens the input layer (`img_in`, 64 -> 128 inputs); no independent reader here "
                 "shows how ComfyUI or kohya tools load that widening, so these files are not written")

SPEC = FamilySpec(
    model="FLUX.1 [dev] with a control LoRA (as BFL's FLUX.1-Depth/Canny-dev-lora)",
    tasks="image-to-image control (a control image per item: depth map, edges, ...), concatenated to the "
          "latents along the channels; samples need `sample.images`",
    targets="as `flux`, plus the widened input layer `x_embedder`",
    **diffusers_files_only(_NO_REFERENCE),
    layers="diffpipe.families.flux.layers",
    sampling={
        None: SampleDefaults(28, 3.5),
    },
)
