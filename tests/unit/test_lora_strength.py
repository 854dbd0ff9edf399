"""LoRA files at their trained strength in the tools that read them: the pieces, without training.

The end-to-end checks (every family's files through ComfyUI's rules, diffusers' loader
and PEFT's deltas) are in ``tests/stages/test_export_formats.py``; these check the
name tables at full size against ComfyUI's published rules (``tests/comfy_rules.py``)
and the metadata.
"""

from __future__ import annotations

import comfy_rules
import pytest
import torch
from diffusers import HunyuanVideoTransformer3DModel

from diffpipe.export.keymaps import keymap_for_model, mapped_families
from diffpipe.export.kohya import base_model_version


def test_kohya_metadata_refuses_a_family_without_a_version():
    with pytest.raises(ValueError, match="'newfamily'"):
        base_model_version("newfamily", {"cross_attention_dim": 768})


@pytest.mark.parametrize("family", mapped_families())
def test_every_mapped_family_has_a_kohya_version(family):
    version, arch, impl = base_model_version(family, {"cross_attention_dim": 768})
    assert version and arch.endswith("/lora") and impl.startswith("https://")


def test_hunyuanvideo_full_size_names_all_land_in_comfyui():
    """The published-size HunyuanVideo (one block of each kind): every comfyui and kohya name
    maps, through ComfyUI's key map, to the weight ComfyUI loads for that original layer."""
    with torch.device("meta"):
        model = HunyuanVideoTransformer3DModel(num_layers=1, num_single_layers=1, num_refiner_layers=1)
    keymap = keymap_for_model("hunyuanvideo", model)
    weights = {comfy_rules.model_weight("hunyuanvideo", la.original): la for la in keymap.layers}
    key_map = comfy_rules.lora_key_map("hunyuanvideo", list(weights))
    for layer in keymap.layers:
        weight = comfy_rules.model_weight("hunyuanvideo", layer.original)
        assert key_map.get(f"diffusion_model.{layer.comfy_name}") == weight, layer.original
        assert key_map.get(layer.kohya) == weight, (layer.original, layer.kohya)
    names = {la.kohya for la in keymap.layers}
    assert "lora_unet_double_blocks_0_img_mlp_0" in names and "lora_unet_single_blocks_0_modulation_lin" in names
    assert {la.comfy_name for la in keymap.layers} >= {"time_in.in_layer", "txt_in.t_embedder.in_layer"}
