"""Key-map tables and the exact fused-LoRA algebra (no model weights needed)."""

from typing import get_args

import pytest
import torch
from safetensors.torch import load_file

from diffpipe.config import ExportFormat
from diffpipe.export.convert import Lora, from_original, to_original
from diffpipe.export.keymaps import KeyMap, Layer, Segment
from diffpipe.families.sd.keymap import module_pairs
from diffpipe.paths import FORMATS


def test_config_formats_match_paths():
    assert set(get_args(ExportFormat)) == set(FORMATS)


def test_sd_table_follows_ldm_block_numbering():
    config = {
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
        "layers_per_block": 2,
    }
    pairs = module_pairs(config)
    assert pairs["down_blocks.0.resnets.1.conv1"] == "input_blocks.2.0.in_layers.2"
    assert pairs["down_blocks.0.downsamplers.0.conv"] == "input_blocks.3.0.op"
    assert pairs["down_blocks.1.attentions.0.proj_in"] == "input_blocks.4.1.proj_in"
    assert pairs["mid_block.resnets.1.time_emb_proj"] == "middle_block.2.emb_layers.1"
    assert (
        pairs["up_blocks.0.attentions.2.transformer_blocks.0.attn2.to_k"]
        == "output_blocks.2.1.transformer_blocks.0.attn2.to_k"
    )
    assert pairs["up_blocks.0.upsamplers.0.conv"] == "output_blocks.2.2.conv"
    assert pairs["up_blocks.1.resnets.2.conv_shortcut"] == "output_blocks.5.0.skip_connection"


def _fused_map() -> KeyMap:
    segs = (Segment("q", 0, 3), Segment("k", 0, 3), Segment("v", 0, 3))
    return KeyMap(
        "t",
        [Layer("qkv", "lora_unet_qkv", segs), Layer("mod", "lora_unet_mod", (Segment("m", 2, 2), Segment("m", 0, 2)))],
    )


def test_fused_lora_is_block_structured_and_exact():
    g = torch.Generator().manual_seed(0)
    mods = {
        m: Lora(torch.randn(2, 5, generator=g), torch.randn(3, 2, generator=g), a) for m, a in (("q", 4.0), ("v", 2.0))
    }
    mods["m"] = Lora(torch.randn(2, 5, generator=g), torch.randn(4, 2, generator=g), 3.0)
    loras, layout = to_original(mods, _fused_map())
    by_name = {layer.original: lora for layer, lora in loras.items()}
    qkv = by_name["qkv"]
    assert qkv.down.shape == (4, 5) and qkv.up.shape == (9, 4) and qkv.scale == 1.0
    assert torch.all(qkv.up[3:6] == 0), "k has no LoRA: zero rows"
    assert torch.all(qkv.up[0:3, 2:] == 0) and torch.all(qkv.up[6:9, :2] == 0), "block-diagonal"
    fused = qkv.delta()
    torch.testing.assert_close(fused[0:3], mods["q"].delta())
    torch.testing.assert_close(fused[6:9], mods["v"].delta())
    mod = by_name["mod"].delta()  # halves swapped
    torch.testing.assert_close(torch.cat([mod[2:], mod[:2]]), mods["m"].delta())
    back = from_original(loras, layout)
    assert set(back) == {"q", "v", "m"}
    for name, lora in mods.items():
        torch.testing.assert_close(back[name].down, lora.down)
        torch.testing.assert_close(back[name].up, lora.up)
        assert back[name].alpha == lora.alpha


def test_workflow_always_exports_diffusers_for_samples():
    from diffpipe import workflow as dw
    from diffpipe.config import parse_config

    cfg = parse_config(
        {"datasets": [{"name": "d", "path": "x"}], "export": {"formats": ["kohya", "merged"]}, "output_dir": "r"}
    )
    assert dw.export_formats(cfg) == ["diffusers", "kohya", "merged"]
    outputs = dw.export_outputs(cfg)
    assert outputs["diffusers"] == "r/export/pytorch_lora_weights.safetensors"
    assert outputs["merged"] == "r/export/merged/model_index.json" and outputs["card"] == "r/export/README.md"
    assert dw.export_format_args(cfg) == "--format diffusers --format kohya --format merged"


def test_workflow_declares_each_trained_parts_export_files():
    """Wan 2.2 A14B with both experts: the low-noise expert's diffusers and peft files are outputs too."""
    from diffpipe import workflow as dw
    from diffpipe.config import parse_config

    model = {"family": "wan", "variant": "2.2-a14b", "expert": "both"}
    cfg = parse_config(
        {"model": model, "datasets": [{"name": "d", "path": "x"}], "export": {"formats": ["peft"]}, "output_dir": "r"}
    )
    outputs = dw.export_outputs(cfg)
    assert outputs["diffusers_low_noise"] == "r/export/pytorch_lora_weights_low_noise.safetensors"
    assert outputs["peft_low_noise"] == "r/export/peft_low_noise/adapter_model.safetensors"
    assert set(outputs) == {"diffusers", "peft", "diffusers_low_noise", "peft_low_noise", "card", "hub_card"}


def test_every_mapped_family_names_its_denoiser():
    from diffpipe.export.keymaps import mapped_families

    assert set(mapped_families()) >= {
        "sd",
        "sdxl",
        "flux",
        "chroma",
        "sd3",
        "lumina2",
        "qwenimage",
        "hidream",
        "wan",
        "flux-kontext",
        "qwenimage-edit",
        "ltxvideo",
        "hunyuanvideo",
        "mochi",
        "cosmos2",
        "cogvideox",
        "cogview4",
    }


def test_dashed_family_names_find_their_module():
    from diffpipe.export.keymaps import _table
    from diffpipe.families.flux_kontext.keymap import build

    sizes = _sizes(["single_transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.proj_out"])
    denoiser, builder = _table("flux-kontext")
    assert denoiser.__name__ == "FluxTransformer2DModel" and builder is build
    km = builder({"num_layers": 0, "num_single_layers": 0, "num_attention_heads": 1, "attention_head_dim": 8}, sizes)
    assert km.family == "flux-kontext"
    with pytest.raises(ValueError, match="unknown family 'no-such-family'"):
        _table("no-such-family")


def _sizes(names: list[str], n: int = 8) -> dict[str, int]:
    return dict.fromkeys(names, n)


def test_sd3_table_fuses_qkv_and_swaps_the_last_context_modulation():
    from diffpipe.families.sd3.keymap import build

    block = [
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "attn.to_out.0",
        "norm1.linear",
        "norm1_context.linear",
    ]
    sizes = _sizes([f"transformer_blocks.{i}.{m}" for i in range(2) for m in block] + ["norm_out.linear", "proj_out"])
    sizes["transformer_blocks.0.attn.to_add_out"] = 8  # only the last block lacks the context output
    km = build({"num_layers": 2}, sizes)
    qkv = km.by_original["joint_blocks.1.context_block.attn.qkv"]
    assert [s.module for s in qkv.segments] == [f"transformer_blocks.1.attn.add_{p}_proj" for p in "qkv"]
    assert km.by_original["joint_blocks.0.context_block.attn.proj"].modules == ["transformer_blocks.0.attn.to_add_out"]
    assert km.by_original["joint_blocks.0.context_block.adaLN_modulation.1"].is_plain
    last = km.by_original["joint_blocks.1.context_block.adaLN_modulation.1"]
    assert [(s.start, s.size) for s in last.segments] == [(4, 4), (0, 4)], "(shift, scale) vs diffusers' (scale, shift)"
    assert km.by_original["final_layer.linear"].kohya == "lora_unet_final_layer_linear"


def test_wan_table_writes_no_alpha_outside_the_blocks():
    from diffpipe.families.wan.keymap import build

    sizes = _sizes(
        [
            "patch_embedding",
            "proj_out",
            "condition_embedder.time_proj",
            "blocks.0.attn1.to_out.0",
            "blocks.0.attn2.add_k_proj",
            "blocks.0.ffn.net.0.proj",
        ]
    )
    km = build({"num_layers": 1}, sizes)
    assert km.by_module["blocks.0.attn1.to_out.0"].original == "blocks.0.self_attn.o"
    assert km.by_module["blocks.0.attn2.add_k_proj"].kohya == "lora_unet_blocks_0_cross_attn_k_img"
    assert km.by_module["blocks.0.ffn.net.0.proj"].original == "blocks.0.ffn.0"
    assert km.by_module["blocks.0.ffn.net.0.proj"].alpha_key
    for module, original in (("proj_out", "head.head"), ("condition_embedder.time_proj", "time_projection.1")):
        layer = km.by_module[module]
        assert layer.original == original and layer.fold_scale and not layer.alpha_key


def test_lumina2_qkv_splits_by_module_size():
    from diffpipe.families.lumina2.keymap import build

    sizes = {"layers.0.attn.to_q": 12, "layers.0.attn.to_k": 4, "layers.0.attn.to_v": 4}
    km = build({"num_layers": 1, "num_refiner_layers": 0}, sizes)
    qkv = km.by_original["layers.0.attention.qkv"]
    assert [s.size for s in qkv.segments] == [12, 4, 4] and km.peft_names


def test_layer_without_alpha_key_is_written_bare_and_read_back_at_scale_one(tmp_path):
    from diffpipe.export.original_io import read_original, write_original

    g = torch.Generator().manual_seed(0)
    lora = Lora(torch.randn(2, 5, generator=g), torch.randn(3, 2, generator=g), 2.0)
    out = write_original({"a": lora}, {}, tmp_path / "x.safetensors", without_alpha=frozenset({"a"}), peft_names=True)
    named, _, _ = read_original(out)
    assert named["a"].alpha == 2.0 and torch.equal(named["a"].up, lora.up)
    assert set(load_file(str(out))) == {"a.lora_A.weight", "a.lora_B.weight"}
    with pytest.raises(ValueError, match="alpha 3.0 != rank 2"):
        write_original(
            {"a": Lora(lora.down, lora.up, 3.0)}, {}, tmp_path / "y.safetensors", without_alpha=frozenset({"a"})
        )


def test_video_tables_rename_and_swap_as_the_original_checkpoints():
    from diffpipe.families.hunyuanvideo import keymap as hunyuanvideo
    from diffpipe.families.ltxvideo import keymap as ltxvideo
    from diffpipe.families.mochi import keymap as mochi

    ltx = ltxvideo.build({}, _sizes(["proj_in", "time_embed.linear", "transformer_blocks.0.attn1.to_q"]))
    assert ltx.by_module["proj_in"].original == "patchify_proj"
    assert ltx.by_module["time_embed.linear"].kohya == "lora_unet_adaln_single_linear"
    assert ltx.by_module["transformer_blocks.0.attn1.to_q"].original == "transformer_blocks.0.attn1.to_q"
    assert ltx.peft_names and not any(layer.alpha_key for layer in ltx.layers)

    block = ["norm1.linear", "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.add_q_proj", "attn1.add_k_proj"]
    block += ["attn1.add_v_proj", "ff.net.0.proj"]
    sizes = _sizes([f"transformer_blocks.{i}.{m}" for i in range(2) for m in block] + ["norm_out.linear"])
    sizes |= {"transformer_blocks.0.norm1_context.linear": 8, "transformer_blocks.1.norm1_context.linear_1": 8}
    km = mochi.build({"num_layers": 2}, sizes)
    w1 = km.by_original["blocks.1.mlp_x.w1"]
    assert [(s.start, s.size) for s in w1.segments] == [(4, 4), (0, 4)], "SwiGLU halves in the other order"
    assert km.by_module["transformer_blocks.1.norm1_context.linear_1"].original == "blocks.1.mod_y"
    assert km.by_original["blocks.0.attn.qkv_y"].modules[0] == "transformer_blocks.0.attn1.add_q_proj"

    refiner = "context_embedder.token_refiner.refiner_blocks.0"
    sizes = _sizes([f"{refiner}.attn.to_{p}" for p in "qkv"] + [f"{refiner}.norm_out.linear", "norm_out.linear"])
    sizes |= {f"single_transformer_blocks.0.{m}": n for m, n in (("attn.to_q", 8), ("attn.to_k", 8),
                                                                  ("attn.to_v", 8), ("proj_mlp", 32))}
    km = hunyuanvideo.build({"num_refiner_layers": 1, "num_layers": 0, "num_single_layers": 1}, sizes)
    assert km.by_module[f"{refiner}.attn.to_k"].original == "txt_in.individual_token_refiner.blocks.0.self_attn_qkv"
    assert km.by_module[f"{refiner}.norm_out.linear"].kohya == (
        "lora_unet_txt_in_individual_token_refiner_blocks_0_adaLN_modulation_1"
    )
    assert [s.size for s in km.by_original["single_blocks.0.linear1"].segments] == [8, 8, 8, 32]
    final = km.by_original["final_layer.adaLN_modulation.1"]
    assert [(s.start, s.size) for s in final.segments] == [(4, 4), (0, 4)], "(shift, scale) vs (scale, shift)"
    assert km.peft_names and all(layer.fold_scale and not layer.alpha_key for layer in km.layers)
