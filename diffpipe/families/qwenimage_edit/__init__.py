"""Family ``qwenimage-edit``: Qwen-Image-Edit."""

from __future__ import annotations

from diffpipe.models.spec import Absent, FamilySpec, SampleDefaults

SPEC = FamilySpec(
    model="Qwen-Image-Edit; Qwen-Image-Edit-2509 and 2511 (Edit-Plus: `variant` `2509` or `2511`)",
    tasks="image editing (a control image per item; the text encoder sees it too); Edit-Plus: up to 4 reference "
          "images per item (`control_path` as a list of folders)",
    targets="as `qwenimage`",
    comfyui_readers="ComfyUI, `QwenImageEditPipeline.load_lora_weights`",
    kohya_readers="ComfyUI, musubi-tuner names, `QwenImageEditPipeline.load_lora_weights`",
    comfy_reads_diffusers="all",
    layers=Absent("not implemented yet"),
    sampling={
        None: SampleDefaults(50, 4.0),
    },
)
