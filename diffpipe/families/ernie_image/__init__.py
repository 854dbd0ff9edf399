"""Family ``ernie-image``: ERNIE-Image (and Turbo)."""

from __future__ import annotations

from diffpipe.families.ernie_image.flavors import PUBLISHED
from diffpipe.models.spec import FamilySpec, Kohya

SPEC = FamilySpec(
    name="ernie-image",
    family_class="ErnieImageFamily",
    model="ERNIE-Image, ERNIE-Image-Turbo",
    tasks="text-to-image (flow matching; Mistral 3 text, one token stream for image and text, FLUX.2's VAE)",
    targets="attention `self_attention.to_q/k/v/out.0`, gated feed-forward `mlp.gate_proj/up_proj/linear_fc2`",
    published=tuple(PUBLISHED),
    # No kohya-family trainer names ERNIE-Image yet: the metadata says what the file is in the same scheme.
    kohya=Kohya("ernie_image", "ernie-image/lora", "https://huggingface.co/baidu/ERNIE-Image"),
    comfyui_readers="ComfyUI's generic LoRA names (`diffusion_model.` + the checkpoint's layer names, which "
                    "are diffusers'); `diffpipe import-lora`",
    kohya_readers="ComfyUI's generic LoRA names (`lora_unet_` + the layer path); `diffpipe import-lora`",
    comfy_reads_diffusers="none",
)
