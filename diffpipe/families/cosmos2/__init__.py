"""Family ``cosmos2``: Cosmos-Predict2 2B / 14B."""

from __future__ import annotations

from diffpipe.families.cosmos2.flavors import PUBLISHED
from diffpipe.models.spec import FamilySpec, Kohya

SPEC = FamilySpec(
    name="cosmos2",
    family_class="Cosmos2Family",
    model="Cosmos-Predict2 2B / 14B",
    tasks="text-to-image",
    targets="self and cross attention `attn1/attn2.to_q/k/v/out.0`, `ff.net.0.proj`, `ff.net.2`",
    published=tuple(PUBLISHED),
    kohya=Kohya("cosmos_predict2", "cosmos-predict2/lora", "https://github.com/nvidia-cosmos/cosmos-predict2"),
    comfyui_readers="ComfyUI (Cosmos-Predict2 names without `net.`); diffusers has no reader: use the diffusers file",
    kohya_readers="ComfyUI",
    comfy_reads_diffusers="none",
)
