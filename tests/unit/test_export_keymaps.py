"""Key-map tables and the exact fused-LoRA algebra (no model weights needed)."""

from typing import get_args

import torch

from diffpipe.config import ExportFormat
from diffpipe.export.convert import Lora, from_original, to_original
from diffpipe.export.keymaps import KeyMap, Layer, Segment
from diffpipe.export.keymaps.sd import module_pairs
from diffpipe.paths import FORMATS


def test_config_formats_match_paths():
    assert set(get_args(ExportFormat)) == set(FORMATS)


def test_sd_table_follows_ldm_block_numbering():
    config = {"down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"], "up_block_types":
              ["CrossAttnUpBlock2D", "UpBlock2D"], "layers_per_block": 2}
    pairs = module_pairs(config)
    assert pairs["down_blocks.0.resnets.1.conv1"] == "input_blocks.2.0.in_layers.2"
    assert pairs["down_blocks.0.downsamplers.0.conv"] == "input_blocks.3.0.op"
    assert pairs["down_blocks.1.attentions.0.proj_in"] == "input_blocks.4.1.proj_in"
    assert pairs["mid_block.resnets.1.time_emb_proj"] == "middle_block.2.emb_layers.1"
    assert pairs["up_blocks.0.attentions.2.transformer_blocks.0.attn2.to_k"] == \
        "output_blocks.2.1.transformer_blocks.0.attn2.to_k"
    assert pairs["up_blocks.0.upsamplers.0.conv"] == "output_blocks.2.2.conv"
    assert pairs["up_blocks.1.resnets.2.conv_shortcut"] == "output_blocks.5.0.skip_connection"


def _fused_map() -> KeyMap:
    segs = (Segment("q", 0, 3), Segment("k", 0, 3), Segment("v", 0, 3))
    return KeyMap("t", [Layer("qkv", "lora_unet_qkv", segs),
                        Layer("mod", "lora_unet_mod", (Segment("m", 2, 2), Segment("m", 0, 2)))])


def test_fused_lora_is_block_structured_and_exact():
    g = torch.Generator().manual_seed(0)
    mods = {m: Lora(torch.randn(2, 5, generator=g), torch.randn(3, 2, generator=g), a)
            for m, a in (("q", 4.0), ("v", 2.0))}
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

    cfg = parse_config({"datasets": [{"name": "d", "path": "x"}], "export": {"formats": ["kohya", "merged"]},
                        "output_dir": "r"})
    assert dw.export_formats(cfg) == ["diffusers", "kohya", "merged"]
    outputs = dw.export_outputs(cfg)
    assert outputs["diffusers"] == "r/export/pytorch_lora_weights.safetensors"
    assert outputs["merged"] == "r/export/merged/model_index.json" and outputs["card"] == "r/export/README.md"
    assert dw.export_format_args(cfg) == "--format diffusers --format kohya --format merged"
