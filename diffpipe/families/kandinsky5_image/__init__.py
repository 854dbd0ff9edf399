"""Family ``kandinsky5-image``: Kandinsky 5.0 Image Lite (text-to-image and editing)."""

from __future__ import annotations

from diffpipe.families.kandinsky5.__init__ import _NO_REFERENCE
from diffpipe.models.spec import FamilySpec, SampleDefaults, diffusers_files_only

SPEC = FamilySpec(
    model="Kandinsky 5.0 Image Lite: text-to-image (`variant: t2i`, the default) and editing (`i2i`)",
    tasks="text-to-image on the video models' transformer, FLUX.1's VAE; Qwen2.5-VL + CLIP text; editing: the "
          "image to edit (each item's control image) as visual-condition channels and seen by the text encoder",
    targets="as `kandinsky5`",
    layers="diffpipe.families.kandinsky5.layers",
    layers_refused="`variant: i2i`",
    **diffusers_files_only(_NO_REFERENCE),
    sampling={
        None: SampleDefaults(50, 3.5),
    },
)
