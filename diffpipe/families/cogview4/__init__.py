"""Family ``cogview4``: CogView4-6B."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, SampleDefaults

_IMPORT = "`diffpipe import-lora {path}` (to continue training); elsewhere use the diffusers file"

SPEC = FamilySpec(
    model="CogView4-6B",
    tasks="text-to-image (per-prompt text length)",
    targets="`attn1.to_q/k/v/out.0`, `ff.net.0.proj`, `ff.net.2`",
    comfyui_readers="THUDM's SAT names (fused `query_key_value`); ComfyUI has no CogView4 model and diffusers has no reader: `diffpipe import-lora` reads it, use the diffusers file elsewhere",
    kohya_readers="`diffpipe import-lora`",
    comfy_reads_diffusers="no-model",
    how_to_load={
        "comfyui": _IMPORT + " (ComfyUI has no CogView4 model)",
        "kohya": _IMPORT + " (no A1111, Forge or ComfyUI model reads CogView4)",
    },
    sampling={
        None: SampleDefaults(50, 5.0),
    },
)
