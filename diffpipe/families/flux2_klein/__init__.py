"""Family ``flux2-klein``: FLUX.2 [klein] 4B / 9B."""

from __future__ import annotations

from diffpipe.models.spec import FamilySpec, SampleDefaults

SPEC = FamilySpec(
    model="FLUX.2 [klein] 4B / 9B (base and distilled)",
    tasks="text-to-image (flow matching; Qwen3 text, 2x2-patchified latents normalised by the VAE's batch norm); "
          "editing with up to 4 reference images (`variant: edit`, the same checkpoints)",
    targets="attention of both streams `attn.to_q/k/v/out.0`, `add_q/k/v_proj`, `to_add_out`, the double "
            "blocks' `ff(_context).linear_in/out`, the single blocks' fused `attn.to_qkv_mlp_proj`",
    layers_refused="`variant: edit`",
    comfyui_readers="ComfyUI (original names, fused `qkv`), `Flux2KleinPipeline.load_lora_weights` (except a "
                    "LoRA on `norm_out`)",
    kohya_readers="ComfyUI; `Flux2KleinPipeline.load_lora_weights` (blocks, input embedders, timestep, output)",
    sampling={
        None: SampleDefaults(50, 4.0),
    },
)
