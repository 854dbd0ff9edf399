"""Family ``wan``: Wan 2.1 T2V 1.3B/14B (`variant: 2.1`), Wan 2.1 I2V 14B (`2.1-i2v`), Wan 2.1 FLF2V 14B (`2.1-flf2v`), Wan 2.2 TI2V-5B (`2.2-5b`; image-conditioned: `2.2-5b-i2v`), Wan 2.2 T2V-A14B and I2V-A14B (`2.2-a14b`, `2.2-i2v-a14b`; `expert: high`, `low` or `both`)."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, SampleDefaults

SPEC = FamilySpec(
    model="Wan 2.1 T2V 1.3B/14B (`variant: 2.1`), Wan 2.1 I2V 14B (`2.1-i2v`), Wan 2.1 FLF2V 14B (`2.1-flf2v`), Wan 2.2 TI2V-5B (`2.2-5b`; image-conditioned: `2.2-5b-i2v`), Wan 2.2 T2V-A14B and I2V-A14B (`2.2-a14b`, `2.2-i2v-a14b`; `expert: high`, `low` or `both`)",
    tasks="text-to-video, image-to-video, first-and-last-frame-to-video (images train as 1-frame clips); 16 fps, 4k+1 frames",
    targets="self/cross attention `to_q/k/v/out.0`, `ffn.net.0.proj`, `ffn.net.2`",
    comfyui_readers="ComfyUI, `WanPipeline.load_lora_weights` (except a LoRA on `patch_embedding`)",
    kohya_readers="ComfyUI, musubi-tuner; `WanPipeline.load_lora_weights` with the default (block) targets",
    layers_refused="the image-conditioned variants, `expert: both`",
    sampling={
        None: SampleDefaults(50, 5.0),
    },
)
