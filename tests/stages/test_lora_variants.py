"""DoRA, LoKr and LoHa (``train.lora.kind``): every format that can hold them, read back by its reference.

Per kind and family (an SD UNet, Flux, Wan, Qwen-Image), an adapter with random nonzero
tensors stands in for a trained one (a short ``diffpipe train`` with kind lokr runs at the
end). References: PEFT's ``get_delta_weight`` and the PEFT model's own output; ComfyUI's
LyCORIS rules restated in ``tests/comfy_rules.py`` for the comfyui and kohya files; the
stock pipeline's ``load_lora_weights`` for the diffusers file (DoRA); ``from_pretrained``
for the merged folder; ``diffpipe import-lora`` round trips.
"""

from __future__ import annotations

import comfy_rules
import pytest
import torch
import yaml
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file
from stage_cli import in_process
from test_export_formats import _forward_inputs, _out

from diffpipe.config import LoraConfig, ModelConfig
from diffpipe.export import export_lora, import_lora
from diffpipe.export.keymaps import keymap_for_model
from diffpipe.families import get_family
from diffpipe.training.adapter import add_lora, apply_adapter, lora_state_dict, peft_config, save_adapter

TOL = 1e-5
# Plain (unfused) layers per family, so the comfyui/kohya files can hold LoKr/LoHa: Flux's
# attention q, k, v are fused in its original checkpoint (refused: see the test below).
TARGETS = {
    "sd": ["to_q", "to_out.0", "proj_in"],
    "flux": ["attn.to_out.0", "ff.net.2", "norm1.linear"],
    "wan": ["to_q", "to_v", "ffn.net.2"],
    "qwenimage": ["to_q", "add_k_proj", "img_mlp.net.2"],
}
FORMATS = {"dora": ["diffusers", "peft", "merged"], "lokr": ["peft", "comfyui", "kohya", "merged"],
           "loha": ["peft", "comfyui", "kohya", "merged"]}
CASES = [(f, k) for f in TARGETS for k in FORMATS]
LYCORIS = [c for c in CASES if c[1] != "dora"]
DORA = [c for c in CASES if c[1] == "dora"]


def _ids(cases):
    return [f"{f}-{k}" for f, k in cases]


def _adapter_deltas(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, BaseTunerLayer) and mod.active_adapters:
            (adapter,) = mod.active_adapters
            out[name.removeprefix("base_model.model.")] = mod.get_delta_weight(adapter).detach().float()
    return out


@pytest.fixture(scope="module", params=CASES, ids=_ids(CASES))
def variant(request, tmp_path_factory):
    name, kind = request.param
    family = get_family(ModelConfig(family=name, flavor="tiny"))
    inputs = _forward_inputs(family)
    denoiser = family.load_denoiser()
    base_out = _out(denoiser, inputs)
    options = {"lokr_factor": 2} if kind == "lokr" else {}
    lora_cfg = peft_config(LoraConfig(kind=kind, rank=2, alpha=3.0, targets=TARGETS[name], **options), TARGETS[name])
    add_lora(denoiser, lora_cfg)
    g = torch.Generator().manual_seed(1)
    for pname, p in denoiser.named_parameters():
        if p.requires_grad:  # every adapter tensor nonzero (LoKr's w2 and LoRA's B start at zero)
            scale = 0.3 if "magnitude" in pname else 0.2
            p.data = p.data + torch.randn(p.shape, generator=g) * scale
    root = tmp_path_factory.mktemp(f"variant-{name}-{kind}")
    save_adapter(root / "adapter", lora_state_dict(denoiser), lora_cfg, {"family": name, "flavor": "tiny", "step": 3})
    result = export_lora(root / "adapter", root / "export", family, FORMATS[kind])
    return {"family": family, "kind": kind, "inputs": inputs, "base_out": base_out, "denoiser": denoiser,
            "trained_out": _out(denoiser, inputs), "deltas": _adapter_deltas(denoiser), "files": result.files,
            "root": root}


def test_adapter_changes_the_output(variant):
    assert (variant["trained_out"] - variant["base_out"]).abs().max() > 1e-3


@pytest.mark.parametrize("variant", LYCORIS, indirect=True, ids=_ids(LYCORIS))
def test_lycoris_files_place_the_trained_delta_in_comfyui(variant):
    """comfyui and kohya files through ComfyUI's key map and LoKr/LoHa arithmetic: PEFT's delta, per module."""
    family = variant["family"]
    keymap = keymap_for_model(family.name, family.load_denoiser())
    shapes = {k: v.shape for k, v in variant["deltas"].items()}
    for fmt in ("comfyui", "kohya"):
        weight_of = {comfy_rules.model_weight(family.name, la.original): la for la in keymap.layers}
        key_map = comfy_rules.lora_key_map(family.name, list(weight_of))
        if family.name == "sd":
            key_map |= {la.kohya: comfy_rules.model_weight(family.name, la.original) for la in keymap.layers}
        tensors = load_file(str(variant["files"][fmt]))
        patches = comfy_rules.lycoris_patches(tensors)
        assert {k.rsplit(".", 1)[0] for k in tensors} == set(patches), "every tensor is part of a patch"
        unplaced = sorted(set(patches) - set(key_map))
        assert not unplaced, f"{fmt}: ComfyUI would not load {unplaced[:3]}"
        got = {}
        for layer_name, make in patches.items():
            module = weight_of[key_map[layer_name]].segments[0].module
            got[module] = make(shapes[module])
        assert set(got) == set(variant["deltas"])
        for module, delta in variant["deltas"].items():
            assert (got[module] - delta).abs().max() <= TOL, f"{fmt}: {module}"


@pytest.mark.parametrize("variant", DORA, indirect=True, ids=_ids(DORA))
def test_diffusers_file_in_stock_pipeline(variant):
    """DoRA: the stock pipeline's ``load_lora_weights`` gives the trained output (LoKr/LoHa: refused)."""
    family = variant["family"]
    pipe = family.load_pipeline()
    pipe.load_lora_weights(str(variant["files"]["diffusers"]))
    denoiser = getattr(pipe, family.denoiser_attr)
    out = _out(denoiser, variant["inputs"])
    assert (out - variant["base_out"]).abs().max() > 1e-3
    torch.testing.assert_close(out, variant["trained_out"], rtol=1e-5, atol=1e-5)


def test_merged_folder_equals_the_adapter(variant):
    family = variant["family"]
    merged = family.pipeline_class.from_pretrained(str(variant["files"]["merged"]))
    torch.testing.assert_close(_out(getattr(merged, family.denoiser_attr), variant["inputs"]),
                               variant["trained_out"], rtol=1e-4, atol=1e-5)


def test_import_round_trip(variant, tmp_path):
    family = variant["family"]
    for fmt, path in variant["files"].items():
        if fmt == "merged":
            continue
        result = import_lora(path, tmp_path / fmt, family)
        assert result.format == fmt
        model = apply_adapter(family.load_denoiser(), tmp_path / fmt)
        got = _adapter_deltas(model)
        assert set(got) == set(variant["deltas"]), fmt
        for module, delta in variant["deltas"].items():
            assert (got[module] - delta).abs().max() <= TOL, f"{fmt}: {module}"
        torch.testing.assert_close(_out(model, variant["inputs"]), variant["trained_out"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", [("flux", "lokr")], indirect=True, ids=["flux-lokr"])
def test_refusals(variant, tmp_path):
    """A variant a format cannot hold exactly is refused by name, before anything is written."""
    family, adapter = variant["family"], variant["root"] / "adapter"
    with pytest.raises(ValueError, match="diffusers.*lokr.*LoRA and DoRA only"):
        export_lora(adapter, tmp_path / "a", family, ["diffusers"])
    assert not (tmp_path / "a").exists()
    # ...as diffusers' own loader says when handed LoKr tensors under diffusers names.
    pipe = family.load_pipeline()
    lokr = {f"transformer.{k}": v for k, v in load_file(str(adapter / "adapter_model.safetensors")).items()}
    with pytest.raises(ValueError, match="Invalid LoRA checkpoint"):
        pipe.load_lora_weights({k.replace("base_model.model.", ""): v for k, v in lokr.items()})
    # LoKr on Flux's q, k, v: the original fuses them into one qkv layer.
    fused = family.load_denoiser()
    cfg = peft_config(LoraConfig(kind="loha", rank=2, targets=["to_q"]), ["to_q"])
    add_lora(fused, cfg)
    save_adapter(tmp_path / "fused", lora_state_dict(fused), cfg, {"family": "flux", "flavor": "tiny"})
    with pytest.raises(ValueError, match=r"comfyui format: the original layer (double_blocks\.0\.img_attn\.qkv|single_blocks\.0\.linear1) fuses"):
        export_lora(tmp_path / "fused", tmp_path / "b", family, ["comfyui"])
    dora = family.load_denoiser()
    cfg = peft_config(LoraConfig(kind="dora", rank=2, targets=["proj_out"]), ["proj_out"])
    add_lora(dora, cfg)
    save_adapter(tmp_path / "dora", lora_state_dict(dora), cfg, {"family": "flux", "flavor": "tiny"})
    for fmt in ("comfyui", "kohya"):
        with pytest.raises(ValueError, match=f"export format {fmt}: a dora adapter cannot be written there"):
            export_lora(tmp_path / "dora", tmp_path / "c", family, [fmt])


def test_train_lokr_end_to_end(tiny_run, tmp_path):
    """``diffpipe train`` with ``train.lora.kind: lokr``, then export and ``import-lora`` (the library: the
    CLI's export and import commands are format-blind and tested in test_export_formats)."""
    from diffpipe.paths import RunPaths
    from diffpipe.training.adapter import load_adapter

    cfg = tiny_run.clone(tmp_path, epochs=1, lora={"kind": "lokr", "rank": 4, "alpha": 4, "lokr_factor": 4})
    result = in_process("train", "-c", str(cfg))
    assert result.returncode == 0, result.stderr[-3000:]
    paths = RunPaths(tmp_path / "run")
    sd, lora_cfg = load_adapter(paths.adapter_dir)
    assert lora_cfg.peft_type.value == "LOKR" and lora_cfg.decompose_factor == 4
    assert any(k.endswith(".lokr_w2") and v.abs().max() > 0 for k, v in sd.items()), "training moved w2 off zero"
    family = get_family(ModelConfig(family="sd", flavor="tiny"))
    files = export_lora(paths.adapter_dir, tmp_path / "export", family, ["peft", "comfyui", "kohya"]).files
    comfy = files["comfyui"]
    assert any(".lokr_w1" in k for k in load_file(str(comfy)))
    expected = _adapter_deltas(apply_adapter(family.load_denoiser(), paths.adapter_dir))
    # The workflow's samples read the PEFT folder for LoKr (diffusers cannot load it).
    from diffpipe import workflow
    from diffpipe.config import SampleConfig, parse_config
    from diffpipe.training.sample import render_samples

    assert workflow.export_formats(parse_config(yaml.safe_load(cfg.read_text())))[0] == "peft"
    grid = render_samples(family.cfg, SampleConfig(prompts=["a red circle"], steps=1, width=32, height=32),
                          files["peft"], tmp_path / "samples")
    assert [p.name for p in grid] == ["grid.png", "sample-00.png"]
    import_lora(comfy, tmp_path / "imported", family)
    got = _adapter_deltas(apply_adapter(family.load_denoiser(), tmp_path / "imported"))
    assert set(got) == set(expected)
    assert all((got[k] - d).abs().max() <= TOL for k, d in expected.items())
