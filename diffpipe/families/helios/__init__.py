"""Family ``helios``: Helios (Base)."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, SampleDefaults, diffusers_files_only

SPEC = FamilySpec(
    model="Helios-Base 14B",
    tasks="text-to-video, trained as the pipeline's first 33-frame chunk (an empty history; later chunks, "
          "which see earlier latents, are not trained) on Wan 2.1's parts; 24 fps, 4k+1 frames",
    targets="as `wan`",
    **diffusers_files_only("not written yet: Helios' LoRAs use Wan's names (diffusers reads them with Wan's "
                           "converters), but its history patch embeddings are not in Wan's key map"),
    sampling={
        None: SampleDefaults(50, 5.0),
    },
)
