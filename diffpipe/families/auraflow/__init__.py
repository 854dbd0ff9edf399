"""Family ``auraflow``: AuraFlow (MMDiT + single DiT blocks, flow matching, UMT5 text)."""

from __future__ import annotations

from diffpipe.families.auraflow.flavors import PUBLISHED
from diffpipe.models.spec import Absent, FamilySpec, Kohya

SPEC = FamilySpec(
    name="auraflow",
    family_class="AuraFlowFamily",
    model="AuraFlow v0.1-0.3",
    tasks="text-to-image (flow matching)",
    targets="attention of both streams, the feed-forwards of both block kinds",
    published=tuple(PUBLISHED),
    # No kohya-family trainer names AuraFlow: the metadata says what the file is in the same scheme.
    kohya=Kohya("auraflow", "auraflow/lora", "https://huggingface.co/fal/AuraFlow"),
    comfyui_readers="ComfyUI's generic LoRA names (`diffusion_model.` + the original checkpoint's layer names: "
                    "`double_layers.N.attn.w2q`, `single_layers.N.mlp.c_fc1`, ...); `diffpipe import-lora`",
    kohya_readers="ComfyUI's generic LoRA names (`lora_unet_` + the original layer path); `diffpipe import-lora`",
    comfy_reads_diffusers="none",
    layers=Absent("not implemented yet"),
)
