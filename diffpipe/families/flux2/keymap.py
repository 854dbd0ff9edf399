"""Key map of family ``flux2``: FLUX.2 [dev]'s transformer is FLUX.2 [klein]'s class with its guidance
embedding (``guidance_in``), so the table is FLUX.2 [klein]'s (``diffpipe.families.flux2_klein.keymap``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffpipe.families.flux2_klein import keymap as klein
from diffpipe.models.keymap import KeyMap
from diffpipe.models.spec import Kohya

DENOISER = klein.DENOISER
KOHYA = Kohya("flux2", "flux-2-dev/lora", "https://github.com/black-forest-labs/flux2")


def build(config: Mapping[str, Any], out_features: Mapping[str, int]) -> KeyMap:
    return klein.build(config, out_features, family="flux2")
