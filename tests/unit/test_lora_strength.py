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


def test_diffusers_file_with_rank_pattern_imports_at_its_strength(tmp_path):
    """A diffusers file whose modules differ in rank (an imported adapter's rank_pattern): the
    folded file's alpha_pattern holds each module's rank, and import reads it back exactly."""
    from diffpipe.config import ModelConfig
    from diffpipe.export.convert import Lora, adapter_from_loras, fold_scale
    from diffpipe.export.diffusers_format import export_diffusers
    from diffpipe.export.import_lora import _diffusers_loras
    from diffpipe.families import get_family

    family = get_family(ModelConfig(family="sd", flavor="tiny"))
    g = torch.Generator().manual_seed(0)
    names = ["down_blocks.1.attentions.0.proj_in", "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"]
    mods = {names[0]: Lora(torch.randn(2, 32, 1, 1, generator=g), torch.randn(32, 2, 1, 1, generator=g), 5.0),
            names[1]: Lora(torch.randn(4, 32, generator=g), torch.randn(32, 4, generator=g), 3.0)}
    sd, cfg = adapter_from_loras(mods)
    assert cfg.rank_pattern, "the two modules differ in rank"
    folded, folded_cfg = fold_scale(sd, cfg)
    path = export_diffusers(folded, folded_cfg, tmp_path / "f.safetensors", family)
    loras, _ = _diffusers_loras(path, f"{family.denoiser_name}.")
    for name, lora in mods.items():
        torch.testing.assert_close(loras[name].delta(), lora.delta(), rtol=1e-5, atol=1e-5)


def test_config_export_formats_follow_the_lora_kind(tmp_path):
    from diffpipe.config import ConfigError, parse_config

    base = {"output_dir": str(tmp_path / "run"), "datasets": [{"name": "d", "path": str(tmp_path / "data")}]}
    lokr = parse_config({**base, "train": {"lora": {"kind": "lokr"}}})
    assert lokr.export.formats == ["peft"]  # the default: diffusers cannot hold LoKr
    with pytest.raises(ConfigError, match="diffusers.*lokr"):
        parse_config({**base, "train": {"lora": {"kind": "lokr"}}, "export": {"formats": ["diffusers", "kohya"]}})
    with pytest.raises(ConfigError, match="kohya.*dora"):
        parse_config({**base, "train": {"lora": {"kind": "dora"}}, "export": {"formats": ["kohya"]}})
    with pytest.raises(ConfigError, match="lokr_factor"):
        parse_config({**base, "train": {"lora": {"kind": "loha", "lokr_factor": 4}}})
    assert parse_config(base).export.formats == ["diffusers"]
