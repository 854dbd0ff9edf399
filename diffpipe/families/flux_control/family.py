"""Family ``flux-control``: control-LoRA training on FLUX.1, the way BFL's depth and canny LoRAs work.

The control image (``datasets[].control_path`` or ``control_column``) is encoded by the Flux VAE and
cached beside the target's latents. As ``FluxControlPipeline`` does, its packed latents are concatenated
to the noisy packed latents along the channels, so the transformer's input layer ``x_embedder`` takes
twice the channels: training widens the base model's ``x_embedder`` with zero weights for the control
half (the base model's output is unchanged until the LoRA learns to use the control) and trains a LoRA
on it besides Flux's usual targets. The exported diffusers file holds ``x_embedder``'s LoRA with the wide
input; ``FluxControlPipeline.load_lora_weights`` on a stock FLUX.1 [dev] widens its ``x_embedder`` the
same way (zeros) before loading, so the pipeline reproduces the trained model (tested). The family's own
pipeline (samples, the merged export) holds the widened base, which alone behaves as FLUX.1 [dev]. Timesteps, noise, shift,
guidance and the target are Flux's.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from diffusers import FluxControlPipeline, FluxTransformer2DModel

from diffpipe.families.flux.family import FluxFamily
from diffpipe.models.base import Prepared


def widen_input(transformer: FluxTransformer2DModel) -> FluxTransformer2DModel:
    """``transformer`` with ``x_embedder`` taking twice the input channels, the new half zero (a transformer
    already widened, ``in_channels == 2 * out_channels``, is returned as it is).

    What ``FluxControlPipeline.load_lora_weights`` does to a stock model before loading a control LoRA
    (it fills the new input columns with zeros); the config's ``in_channels`` doubles, ``out_channels``
    stays (the prediction has the latents' channels).
    """
    old = transformer.x_embedder
    if transformer.config.out_channels and transformer.config.in_channels == 2 * transformer.config.out_channels:
        return transformer
    if transformer.config.in_channels != old.in_features:
        raise ValueError(f"x_embedder takes {old.in_features} inputs, the config says {transformer.config.in_channels}")
    wide = torch.nn.Linear(2 * old.in_features, old.out_features, bias=old.bias is not None,
                           device=old.weight.device, dtype=old.weight.dtype)
    with torch.no_grad():
        wide.weight.zero_()
        wide.weight[:, : old.in_features] = old.weight
        if old.bias is not None:
            wide.bias.copy_(old.bias)
    transformer.x_embedder = wide.requires_grad_(old.weight.requires_grad)
    out_channels = transformer.config.out_channels or transformer.config.in_channels
    transformer.register_to_config(in_channels=2 * old.in_features, out_channels=out_channels)
    return transformer


class FluxControlFamily(FluxFamily):
    pipeline_class = FluxControlPipeline
    trainable_text_encoders: ClassVar[dict[str, str]] = {}  # text-encoder training is tested on flux only
    uses_control = True
    default_lora_targets: ClassVar[list[str]] = [*FluxFamily.default_lora_targets, "x_embedder"]
    #: ``sample.images`` reach ``FluxControlPipeline`` as ``control_image``.
    sample_image_arg: ClassVar[str] = "control_image"

    def load_denoiser(self) -> FluxTransformer2DModel:
        """The base transformer with its input layer widened for the control channels (what is trained)."""
        return self.trained_base(super().load_denoiser())

    def trained_base(self, denoiser: FluxTransformer2DModel) -> FluxTransformer2DModel:
        return widen_input(denoiser)

    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32, control: torch.Tensor | None = None) -> Prepared:
        """Flux's inputs with the packed control latents concatenated to the noisy latents' channels."""
        c = self.reference_image(control, latents)
        if c.shape[-2:] != latents.shape[-2:]:
            raise ValueError(f"flux-control: the control latents are {tuple(c.shape[-2:])}, the target's "
                             f"{tuple(latents.shape[-2:])}: a control image must have its target's size and crop")
        p = super().prepare(latents, text, generator, objective=objective, t=t, noise=noise, mask=mask, dtype=dtype)
        b, ch, h, w = c.shape
        packed = FluxControlPipeline._pack_latents(c, b, ch, h, w).to(p.inputs["hidden_states"])
        p.inputs["hidden_states"] = torch.cat([p.inputs["hidden_states"], packed], dim=2)
        return p

    def sample_kwargs(self, cfg) -> dict[str, Any]:
        if not cfg.images:
            raise ValueError("sample.images: flux-control samples need a control image per prompt")
        return super().sample_kwargs(cfg)
