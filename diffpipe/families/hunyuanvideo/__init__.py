"""Family ``hunyuanvideo``: HunyuanVideo."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, SampleDefaults

SPEC = FamilySpec(
    model="HunyuanVideo",
    tasks="text-to-video; 24 fps, 4k+1 frames, embedded guidance 1.0",
    targets="attention of both streams, both feed-forwards, `proj_mlp`",
    comfyui_readers="ComfyUI (fused `img_attn_qkv`/`linear1`; the embedders under ComfyUI's names `time_in.in_layer`, `txt_in.t_embedder.in_layer`, ...), `HunyuanVideoPipeline.load_lora_weights` (not the final modulation, the token refiner's attention or the embedders, whose names diffusers reads differently)",
    kohya_readers="ComfyUI (`lora_unet_` + ComfyUI's names: `img_mlp_0`, `img_mod_lin`, ...; musubi-tuner's own files say `img_mlp_fc1`, which ComfyUI does not place; `import-lora` reads both)",
    sampling={
        None: SampleDefaults(50, 6.0),
    },
)
