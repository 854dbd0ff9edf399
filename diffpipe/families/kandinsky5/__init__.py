"""Family ``kandinsky5``: Kandinsky 5.0 text-to-video and image-to-video (Video Lite and Pro)."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, SampleDefaults, diffusers_files_only

_NO_REFERENCE = "not checked against an independent reference of Kandinsky 5's original checkpoint names yet"

SPEC = FamilySpec(
    model="Kandinsky 5.0 T2V Lite / Pro, I2V Lite / Pro (`variant: i2v`); the regular-attention checkpoints",
    tasks="text-to-video (images train as 1-frame clips), image-to-video; 24 fps, 4k+1 frames; Qwen2.5-VL + "
          "CLIP text",
    targets="self/cross attention `to_query/key/value`, `out_layer`, feed-forward `in_layer`/`out_layer` "
            "(text blocks included)",
    **diffusers_files_only(_NO_REFERENCE),
    sampling={
        None: SampleDefaults(50, 5.0),
    },
)
