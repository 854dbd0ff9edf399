"""ComfyUI's LoRA reading rules, for the tests: the package's restatement (``diffpipe.export.comfy_rules``),
which the export's verify step also applies (tests import it by this short name)."""

from diffpipe.export.comfy_rules import (  # noqa: F401
    HUNYUAN_LOAD_RENAMES,
    HUNYUAN_LORA_RENAMES,
    LORA_CLIP_MAP,
    ZIMAGE_RENAMES,
    clip_diffusers_lora_keys,
    clip_lora_keys,
    lora_key_map,
    lora_patches,
    lycoris_patches,
    model_weight,
)
