"""Key map of family ``cosmos2-video``: Cosmos-Predict2 Video2World, ``cosmos2``'s table under its own name.

The Video2World checkpoint has the Text2Image block layout and names (one more input
channel, the condition mask, in the same patch embedding); diffusers converts both with
``convert_cosmos_transformer_checkpoint_to_diffusers``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffpipe.families.cosmos2 import keymap as cosmos2
from diffpipe.models.keymap import KeyMap
from diffpipe.models.spec import Kohya

DENOISER = cosmos2.DENOISER
KOHYA = Kohya("cosmos_predict2", "cosmos-predict2/lora", "https://github.com/nvidia-cosmos/cosmos-predict2")


def build(config: Mapping[str, Any], out_features: Mapping[str, int]) -> KeyMap:
    """The table for a transformer with this config; ``out_features``: its module sizes."""
    return KeyMap("cosmos2-video", cosmos2.build(config, out_features).layers)
