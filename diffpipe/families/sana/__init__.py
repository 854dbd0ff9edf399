"""Family ``sana``: Sana (linear-attention DiT, deep-compression autoencoder, Gemma-2 text)."""

from __future__ import annotations

from diffpipe.families.sana.flavors import PUBLISHED
from diffpipe.models.spec import Absent, FamilySpec, Kohya

SPEC = FamilySpec(
    name="sana",
    family_class="SanaFamily",
    model="Sana 1.6B / 600M",
    tasks="text-to-image (flow matching; DC-AE latents, 32x compression)",
    targets="self and cross attention `attn1/attn2.to_q/k/v/out.0`, the Mix-FFN 1x1 convolutions `ff.conv_inverted`, `ff.conv_point`",
    published=tuple(PUBLISHED),
    # No kohya-family trainer names Sana: the metadata says what the file is in the same scheme.
    kohya=Kohya("sana", "sana/lora", "https://github.com/NVlabs/Sana"),
    comfyui_readers="ComfyUI's generic LoRA names (`diffusion_model.` + the original checkpoint's layer names: "
                    "`blocks.N.attn.qkv` (q, k, v fused), `blocks.N.cross_attn.kv_linear`, ...); `diffpipe import-lora`",
    kohya_readers="ComfyUI's generic LoRA names (`lora_unet_` + the original layer path); `diffpipe import-lora`",
    comfy_reads_diffusers="none",
    layers=Absent("not implemented yet"),
)
