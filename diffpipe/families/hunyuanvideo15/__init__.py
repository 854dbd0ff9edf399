"""Family ``hunyuanvideo15``: HunyuanVideo 1.5."""

from __future__ import annotations

from diffpipe.models.spec import Absent, FamilySpec, SampleDefaults, diffusers_files_only, loads_through_transformer

SPEC = FamilySpec(
    model="HunyuanVideo 1.5 (8.3B)",
    tasks="text-to-video (flow matching; Qwen2.5-VL text plus a ByT5 glyph encoder for quoted text); 24 fps, "
          "4k+1 frames; image-to-video not yet",
    targets="as `hunyuanvideo` (both streams' attention and feed-forwards)",
    **diffusers_files_only("not written yet: diffusers 0.42.1 has no LoRA converter for HunyuanVideo 1.5 to "
                           "check original names against"),
    **loads_through_transformer("HunyuanVideo15Pipeline"),
    layers=Absent("not implemented yet"),
    sampling={
        None: SampleDefaults(50, None),
    },
)
