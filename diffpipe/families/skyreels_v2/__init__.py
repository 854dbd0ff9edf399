"""Family ``skyreels-v2``: SkyReels V2 text-to-video, image-to-video and diffusion forcing."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, SampleDefaults

SPEC = FamilySpec(
    model="SkyReels V2 T2V 14B (`variant: t2v`), I2V 14B (`i2v`), diffusion forcing 1.3B / 14B (`df`; from an image: `df-i2v`; continuing a clip: `df-v2v`); 540P, 720P",
    tasks="text-to-video, image-to-video (conditioned as Wan 2.1 I2V), diffusion forcing (a noise level per latent "
          "frame; text-, image- or video-to-video) on Wan 2.1's architecture (images train as 1-frame clips); 24 fps, 4k+1 frames",
    targets="as `wan`",
    comfyui_readers="ComfyUI (as a Wan model), `SkyReelsV2Pipeline.load_lora_weights` and the I2V pipeline's "
                    "(except a LoRA on `patch_embedding`)",
    kohya_readers="ComfyUI, musubi-tuner's Wan layout; `SkyReelsV2Pipeline.load_lora_weights` with the default "
                  "(block) targets",
    layers="diffpipe.families.wan.layers",
    layers_refused="`variant: i2v`, `df`, `df-i2v`, `df-v2v`",
    sampling={
        None: SampleDefaults(50, 6.0),
        "i2v": SampleDefaults(50, 5.0, model="SkyReels V2 I2V 14B"),
        "df-i2v": SampleDefaults(50, 5.0, model="SkyReels V2 diffusion forcing from an image"),
    },
)
