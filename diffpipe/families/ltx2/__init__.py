"""Family ``ltx2``: LTX-2 (its video stream)."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, SampleDefaults

SPEC = FamilySpec(
    model="LTX-2 19B; LTX-2.3 from a local folder (its architecture tested on a tiny rebuild)",
    tasks="text-to-video, image-to-video (`variant: i2v`, the same checkpoint): the video stream of the "
          "audio-video transformer, modalities isolated (the audio stream and the sound are not trained; "
          "samples generate sound, and keep the video); 24 fps, 8k+1 frames, sample sides multiples of 32",
    targets="the video stream's `attn1`/`attn2` `to_q/k/v/out.0`, `ff.net.0.proj`, `ff.net.2`",
    comfyui_readers="ComfyUI (`diffusion_model.` + the original layer names), `LTX2Pipeline.load_lora_weights`",
    kohya_readers="ComfyUI (`lora_unet_` + the original layer path)",
    sampling={
        None: SampleDefaults(30, 3.0),
    },
)
