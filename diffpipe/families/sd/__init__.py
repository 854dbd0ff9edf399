"""Family ``sd``: SD 1.x / 2.x (epsilon or `prediction_type: v_prediction`, optional `zero_terminal_snr`)."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, Kohya

_GENERATIVE_MODELS = "https://github.com/Stability-AI/generative-models"


def _kohya(unet_config) -> Kohya:
    """SD 2.x UNets cross-attend to 1024-wide OpenCLIP states, SD 1.x to 768-wide CLIP ones."""
    if unet_config.get("cross_attention_dim") == 1024:
        return Kohya("sd_v2", "stable-diffusion-v2-512/lora", _GENERATIVE_MODELS)
    return Kohya("sd_v1", "stable-diffusion-v1/lora", _GENERATIVE_MODELS)


SPEC = FamilySpec(
    model="SD 1.x / 2.x (epsilon or `prediction_type: v_prediction`, optional `zero_terminal_snr`)",
    tasks="text-to-image",
    targets="attention, `proj_in/out`, feed-forward, ResNet `conv1/2`, `time_emb_proj`",
    kohya=_kohya,
    comfyui_readers="ComfyUI `models/loras/`, *LoraLoaderModelOnly*",
    kohya_readers="A1111/Forge `<lora:kohya_lora:1>`, ComfyUI, `StableDiffusionPipeline.load_lora_weights`",
    comfy_reads_diffusers="part",
    a1111=True,
)
