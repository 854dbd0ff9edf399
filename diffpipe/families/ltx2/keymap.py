"""Key map of family ``ltx2``: diffusers ``LTX2VideoTransformer3DModel`` <-> the original (LTX-2) checkpoint.

Names follow ``convert_ltx2_transformer_to_diffusers`` in diffusers' ``single_file_utils.py`` (the
single-file converter) and ``_convert_non_diffusers_ltx2_lora_to_diffusers`` (the LoRA converter of
``LTX2Pipeline.load_lora_weights``): the original uses diffusers' block names (``transformer_blocks.N.attn1.to_q``,
``audio_ff.net.0.proj``, ``audio_to_video_attn.to_out.0``, ...) except the top-level patch embeddings
(``patchify_proj``, ``audio_patchify_proj``) and timestep modulations (``adaln_single``,
``audio_adaln_single``, ``av_ca_*_adaln_single``, LTX-2.3's ``prompt_adaln_single``). ComfyUI's LTX-2 model
uses the original names; kohya names are ``lora_unet_`` + the original path (what ComfyUI maps for every
model). As for LTX-Video, the comfyui file names its tensors ``lora_A`` / ``lora_B`` with the scale folded
into ``up`` and no ``.alpha`` key: the diffusers converter reads PEFT names and no alpha.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffusers import LTX2VideoTransformer3DModel

from diffpipe.families.ltxvideo.keymap import renamed_keymap
from diffpipe.models.keymap import KeyMap
from diffpipe.models.spec import Kohya

DENOISER = LTX2VideoTransformer3DModel
KOHYA = Kohya("ltx2", "ltx-2/lora", "https://github.com/Lightricks/LTX-2")

# Our top-level prefix -> the original's; every other name is the same.
RENAMED = {
    "proj_in": "patchify_proj",
    "audio_proj_in": "audio_patchify_proj",
    "time_embed": "adaln_single",
    "audio_time_embed": "audio_adaln_single",
    "av_cross_attn_video_scale_shift": "av_ca_video_scale_shift_adaln_single",
    "av_cross_attn_video_a2v_gate": "av_ca_a2v_gate_adaln_single",
    "av_cross_attn_audio_scale_shift": "av_ca_audio_scale_shift_adaln_single",
    "av_cross_attn_audio_v2a_gate": "av_ca_v2a_gate_adaln_single",
    "prompt_adaln": "prompt_adaln_single",
    "audio_prompt_adaln": "audio_prompt_adaln_single",
}


def build(config: Mapping[str, Any], out_features: Mapping[str, int]) -> KeyMap:
    return renamed_keymap("ltx2", RENAMED, out_features)
