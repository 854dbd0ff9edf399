"""Family ``flux-kontext``: Flux image editing, conditioned on a control (reference) image.

The same components as ``flux`` (``FluxTransformer2DModel``, the Flux VAE,
CLIP + T5) in ``FluxKontextPipeline``. Each training item is a target image
with a control image (``datasets[].control_path`` or ``control_column``),
cached as conditioning latents next to the target's. As the pipeline does,
the control latents are packed into 2x2 tokens and appended after the
target's tokens, with their own position ids (first id axis 1 instead of 0);
the transformer's output for the control tokens is dropped, so the loss (and
a loss mask) covers the target tokens only. Timesteps, noise, shift and
guidance are Flux's: the loss is ``flux``'s with the reference tokens added
around the transformer call.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from diffusers import FluxKontextPipeline, FluxPipeline

from diffpipe.config import SampleConfig
from diffpipe.families.flux.family import FluxFamily
from diffpipe.models.base import Family, Prepared, ReferenceTokens


def reference_tokens(control: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Control latents ``[B, C, h, w]`` -> packed tokens ``[B, hw/4, 4C]`` and ids ``[hw/4, 3]``.

    Exactly ``FluxKontextPipeline.prepare_latents``: the latent ids with the
    first axis set to 1, which tells the reference apart from the target.
    """
    b, c, h, w = control.shape
    tokens = FluxPipeline._pack_latents(control, b, c, h, w)
    ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, control.device, control.dtype)
    ids[..., 0] = 1
    return tokens, ids


class FluxKontextFamily(ReferenceTokens, FluxFamily):
    #: Not the parent family's layers: this family's spec says why it has none.
    pipeline_layers = Family.pipeline_layers
    reference_tokens = staticmethod(reference_tokens)
    pipeline_class = FluxKontextPipeline
    uses_control = True

    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        # The pipeline rescales every output to ``max_area`` (1024² by default), whatever
        # height and width say: keep the configured size.
        return {**super().sample_kwargs(cfg), "max_area": cfg.width * cfg.height}

    def predict(self, denoiser: torch.nn.Module, prepared: Prepared) -> torch.Tensor:
        """Flux's forward with the reference tokens appended; the target tokens' output."""
        tokens, ids = prepared.extra["reference"]
        x, img_ids = prepared.inputs["hidden_states"], prepared.inputs["img_ids"]
        inputs = {**prepared.inputs, "hidden_states": torch.cat([x, tokens.to(x)], dim=1),
                  "img_ids": torch.cat([img_ids, ids.to(img_ids)], dim=0)}
        return super().predict(denoiser, replace(prepared, inputs=inputs))[:, : x.shape[1]]
