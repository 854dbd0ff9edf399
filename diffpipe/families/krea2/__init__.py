"""Family ``krea2``: Krea 2 (Base, Turbo)."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, SampleDefaults, generic_comfy_names

SPEC = FamilySpec(
    model="Krea 2 Base, Krea 2 Turbo",
    tasks="text-to-image (flow matching; Qwen3-VL text at 12 layers, fused inside the transformer)",
    targets="attention `attn.to_q/k/v/out.0`, its `to_gate`, SwiGLU `ff.gate/up/down` (text-fusion blocks included)",
    **generic_comfy_names("the original checkpoint's layer names: `blocks.N.attn.wq`, `blocks.N.mlp.gate`, ..."),
    sampling={
        None: SampleDefaults(28, 4.5),
    },
)
