"""Family ``sd``: SD 1.x / 2.x (epsilon or `prediction_type: v_prediction`, optional `zero_terminal_snr`)."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, SampleDefaults

SPEC = FamilySpec(
    model="SD 1.x / 2.x (epsilon or `prediction_type: v_prediction`, optional `zero_terminal_snr`)",
    tasks="text-to-image",
    targets="attention, `proj_in/out`, feed-forward, ResNet `conv1/2`, `time_emb_proj`",
    comfyui_readers="ComfyUI `models/loras/`, *LoraLoaderModelOnly*",
    kohya_readers="A1111/Forge `<lora:kohya_lora:1>`, ComfyUI, `StableDiffusionPipeline.load_lora_weights`",
    comfy_reads_diffusers="part",
    a1111=True,
    sampling={
        None: SampleDefaults(50, 7.5),
    },
)
