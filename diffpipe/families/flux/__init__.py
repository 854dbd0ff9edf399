"""Family ``flux``: FLUX.1 dev / schnell."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, SampleDefaults

SPEC = FamilySpec(
    model="FLUX.1 dev / schnell",
    tasks="text-to-image",
    targets="attention of both streams, double-block feed-forwards",
    comfyui_readers="ComfyUI (fused `qkv`/`linear1`), `FluxPipeline.load_lora_weights`",
    kohya_readers="Forge, ComfyUI, `FluxPipeline.load_lora_weights`",
    comfy_reads_diffusers="all",
    a1111=True,
    sampling={
        None: SampleDefaults(28, 3.5, model="FLUX.1-dev"),
        # Told apart by its transformer config (no guidance embedder): FluxFamily.sampling_key.
        "schnell": SampleDefaults(4, 0.0, model="FLUX.1-schnell",
                                  source="model card: black-forest-labs/FLUX.1-schnell, not checked here"),
    },
)
