"""Family ``hunyuanimage``: HunyuanImage 2.1."""

from __future__ import annotations

from diffpipe.families.hunyuanimage.flavors import PUBLISHED
from diffpipe.models.spec import Absent, FamilySpec, diffusers_files_only

SPEC = FamilySpec(
    name="hunyuanimage",
    family_class="HunyuanImageFamily",
    model="HunyuanImage 2.1",
    tasks="text-to-image (flow matching; Qwen2.5-VL text plus a ByT5 glyph encoder for quoted text)",
    targets="as `flux`",
    published=tuple(PUBLISHED),
    **diffusers_files_only("not written yet: diffusers 0.42.1 has no LoRA converter for HunyuanImage 2.1 to "
                           "check original names against"),
    # HunyuanImagePipeline has no LoRA loader in diffusers 0.42.1; its transformer's PEFT mixin reads the file.
    how_to_load={"diffusers": "`pipe.transformer.load_lora_adapter(\"{path}\", prefix=\"transformer\")` "
                              "(diffusers 0.42.1's HunyuanImagePipeline has no `load_lora_weights`)"},
    layers=Absent("not implemented yet"),
)
