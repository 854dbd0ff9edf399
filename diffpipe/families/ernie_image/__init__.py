"""Family ``ernie-image``: ERNIE-Image (and Turbo)."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, SampleDefaults, generic_comfy_names

SPEC = FamilySpec(
    model="ERNIE-Image, ERNIE-Image-Turbo",
    tasks="text-to-image (flow matching; Mistral 3 text, one token stream for image and text, FLUX.2's VAE)",
    targets="attention `self_attention.to_q/k/v/out.0`, gated feed-forward `mlp.gate_proj/up_proj/linear_fc2`",
    **generic_comfy_names("the checkpoint's layer names, which are diffusers'"),
    sampling={
        None: SampleDefaults(50, 4.0),
    },
)
