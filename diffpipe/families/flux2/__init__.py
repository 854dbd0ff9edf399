"""Family ``flux2``: FLUX.2 [dev]."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, SampleDefaults

SPEC = FamilySpec(
    model="FLUX.2 [dev]",
    tasks="text-to-image (flow matching, guidance-distilled; Mistral 3 text, 3 layers stacked; FLUX.2 [klein]'s "
          "transformer class and VAE); editing with up to 4 reference images (`variant: edit`, the same "
          "checkpoint)",
    targets="as `flux2-klein`",
    layers="diffpipe.families.flux2_klein.layers",
    layers_refused="`variant: edit`",
    comfyui_readers="ComfyUI (original names, fused `qkv`), `Flux2Pipeline.load_lora_weights` (except a LoRA on "
                    "`norm_out`)",
    kohya_readers="ComfyUI; `Flux2Pipeline.load_lora_weights` (blocks, input embedders, timestep, output; not "
                  "the guidance embedder)",
    sampling={
        None: SampleDefaults(50, 4.0),
    },
)
