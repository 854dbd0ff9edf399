"""Family ``hunyuanimage``: HunyuanImage 2.1."""

from __future__ import annotations

from diffpipe.models.spec import Absent, FamilySpec, SampleDefaults, diffusers_files_only, loads_through_transformer

SPEC = FamilySpec(
    model="HunyuanImage 2.1",
    tasks="text-to-image (flow matching; Qwen2.5-VL text plus a ByT5 glyph encoder for quoted text)",
    targets="as `flux`",
    **diffusers_files_only("not written yet: diffusers 0.42.1 has no LoRA converter for HunyuanImage 2.1 to "
                           "check original names against"),
    **loads_through_transformer("HunyuanImagePipeline"),
    layers=Absent("not implemented yet"),
    sampling={
        None: SampleDefaults(50, 3.25),
    },
)
