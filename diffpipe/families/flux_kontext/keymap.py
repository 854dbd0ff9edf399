"""Key map of family ``flux-kontext``: FLUX.1 Kontext, ``flux``'s table under its own name.

FLUX.1 Kontext's checkpoint has FLUX.1's layout and names: diffusers loads it
into the same ``FluxTransformer2DModel`` with the same single-file converter
(``convert_flux_transformer_checkpoint_to_diffusers``), and ComfyUI loads it as
a Flux model. The table (fused ``qkv`` and ``linear1``, the swapped final
modulation, kohya names ``lora_unet_`` + the original path) is ``flux``'s;
diffusers' Kontext pipeline reads LoRAs with Flux's loader.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffpipe.families.flux import keymap as flux
from diffpipe.models.keymap import KeyMap
from diffpipe.models.spec import Kohya

DENOISER = flux.DENOISER
KOHYA = Kohya("flux1", "flux-1-kontext-dev/lora", "https://github.com/black-forest-labs/flux")


def build(config: Mapping[str, Any], out_features: Mapping[str, int]) -> KeyMap:
    """The table for a transformer with this config; ``out_features``: its module sizes."""
    return KeyMap("flux-kontext", flux.transformer_layers(config, out_features, flux.TOP_LEVEL))
