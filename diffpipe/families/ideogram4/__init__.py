"""Family ``ideogram4``: Ideogram 4."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, SampleDefaults

SPEC = FamilySpec(
    model="Ideogram 4",
    tasks="text-to-image (flow matching; Qwen3-VL text at 13 layers, one packed text + image sequence; the "
          "unconditional transformer of its guidance is loaded for samples, not trained)",
    targets="attention `attention.to_q/k/v/out.0`, SwiGLU `feed_forward.w1/w2/w3`",
    comfyui_readers="`Ideogram4Pipeline.load_lora_weights` (the blocks' layers; ai-toolkit's layout: "
                    "`diffusion_model.` + the original names, fused `attention.qkv`); `diffpipe import-lora`",
    kohya_readers="ComfyUI's generic LoRA names (`lora_unet_` + the original layer path); `diffpipe import-lora`",
    sampling={
        None: SampleDefaults(48, 7.0, source="steps: the stock pipeline's `__call__` default; scale: the value of its "
                             "default guidance schedule over 45 of its 48 steps (samples take one constant scale)"),
    },
)
