"""Family ``sana``: Sana (linear-attention DiT, deep-compression autoencoder, Gemma-2 text)."""

from __future__ import annotations

from diffpipe.models.spec import Absent, FamilySpec, SampleDefaults, generic_comfy_names

SPEC = FamilySpec(
    model="Sana 1.6B / 600M",
    tasks="text-to-image (flow matching; DC-AE latents, 32x compression)",
    targets="self and cross attention `attn1/attn2.to_q/k/v/out.0`, the Mix-FFN 1x1 convolutions `ff.conv_inverted`, `ff.conv_point`",
    **generic_comfy_names("the original checkpoint's layer names: `blocks.N.attn.qkv` (q, k, v fused), "
                          "`blocks.N.cross_attn.kv_linear`, ..."),
    layers=Absent("not implemented yet"),
    sampling={
        None: SampleDefaults(20, 4.5),
    },
)
