"""Family ``krea2``: Krea 2 (Base, Turbo)."""

from __future__ import annotations

from diffpipe.families.krea2.flavors import PUBLISHED
from diffpipe.models.spec import FamilySpec, Kohya

SPEC = FamilySpec(
    name="krea2",
    family_class="Krea2Family",
    model="Krea 2 Base, Krea 2 Turbo",
    tasks="text-to-image (flow matching; Qwen3-VL text at 12 layers, fused inside the transformer)",
    targets="attention `attn.to_q/k/v/out.0`, its `to_gate`, SwiGLU `ff.gate/up/down` (text-fusion blocks included)",
    published=tuple(PUBLISHED),
    # No kohya-family trainer names Krea 2 yet: the metadata says what the file is in the same scheme.
    kohya=Kohya("krea2", "krea-2/lora", "https://github.com/huggingface/diffusers"),
    comfyui_readers="ComfyUI's generic LoRA names (`diffusion_model.` + the original checkpoint's layer names: "
                    "`blocks.N.attn.wq`, `blocks.N.mlp.gate`, ...); `diffpipe import-lora`",
    kohya_readers="ComfyUI's generic LoRA names (`lora_unet_` + the original layer path); `diffpipe import-lora`",
    comfy_reads_diffusers="none",
)
