"""``diffpipe import-lora`` checks every file against the model it is for (issue 38, case 7).

Each broken file is a real export of the tiny SD model (LoRA with a conv layer and a text-encoder
LoRA, LoKr, LoHa) with one thing broken: a wrong shape, ranks that disagree, NaN, a bad alpha,
rank 0, LyCORIS factors whose product does not fit the layer (60000 x 60000 on a 32- or
64-channel layer: checked from the factor shapes, never built), malformed header metadata.
Every one is exit 1 with a message naming the file and the key, and no output folder.
"""

from __future__ import annotations

import json
import re
import shutil

import peft
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from diffpipe.cli import app
from diffpipe.config import LoraConfig, ModelConfig
from diffpipe.export import export_lora
from diffpipe.export.text_encoders import clip_module
from diffpipe.families import get_family
from diffpipe.training.adapter import PEFT_PREFIX, add_lora, lora_state_dict, peft_config, save_adapter

runner = CliRunner()
TARGETS = {"lora": ["to_q", "proj_in", "conv1"], "lokr": ["to_q", "proj_in"], "loha": ["to_q", "proj_in"]}
FORMATS = {"lora": ["diffusers", "comfyui", "kohya", "peft"], "lokr": ["comfyui", "kohya"], "loha": ["comfyui", "kohya"]}


def _text_lora(family) -> dict:
    """A LoRA on the tiny CLIP encoder's first q_proj (SD trains its text encoder too)."""
    encoder = family.load_text_encoders(only=["text_encoder"]).text_encoder
    module = clip_module("encoder.layers.0.self_attn.q_proj", type(encoder))
    out, inp = encoder.get_submodule(module).weight.shape
    g = torch.Generator().manual_seed(2)
    sd = {f"{module}.lora_A.weight": torch.randn(2, inp, generator=g),
          f"{module}.lora_B.weight": torch.randn(out, 2, generator=g)}
    return {"text_encoder": (sd, peft.LoraConfig(r=2, lora_alpha=3.0, target_modules=[module]))}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, object]:
    """``{"lora-diffusers": path, ..., "lokr-comfyui": path, ...}``: good files, built once."""
    family = get_family(ModelConfig(family="sd", flavor="tiny"))
    root = tmp_path_factory.mktemp("import-checks")
    files = {}
    for kind, targets in TARGETS.items():
        denoiser = family.load_denoiser()
        options = {"lokr_factor": 2} if kind == "lokr" else {}
        cfg = peft_config(LoraConfig(kind=kind, rank=2, alpha=3.0, targets=targets, **options), targets)
        add_lora(denoiser, cfg)
        g = torch.Generator().manual_seed(1)
        for p in denoiser.parameters():
            if p.requires_grad:  # nonzero everywhere (B and LoKr's w2 start at zero)
                p.data = p.data + torch.randn(p.shape, generator=g) * 0.2
        text = _text_lora(family) if kind == "lora" else None
        save_adapter(root / kind, lora_state_dict(denoiser), cfg, {"family": "sd", "flavor": "tiny"},
                     text_encoders=text)
        result = export_lora(root / kind, root / f"export-{kind}", family, FORMATS[kind])
        files |= {f"{kind}-{fmt}": path for fmt, path in result.files.items()}
    return files


def _key(tensors: dict, *parts: str) -> str:
    """The first key (sorted) that holds every one of ``parts``."""
    return next(k for k in sorted(tensors) if all(p in k for p in parts))


def _layer(tensors: dict, *parts: str) -> str:
    return _key(tensors, *parts).rpartition(".")[0]


# Each case: (good file, how to break it) -> the key the message must name.
def wrong_shape_comfyui(t, h):
    k = _key(t, "attn1.to_q.lora_down")
    t[k] = torch.randn(2, t[k].shape[1] + 3)
    return k


def wrong_shape_diffusers(t, h):
    k = _key(t, "unet.", "attn1.to_q.lora_B")
    t[k] = torch.randn(t[k].shape[0] + 1, 2)
    return k


def wrong_kernel_kohya(t, h):
    k = _key(t, "conv1.lora_down")
    t[k] = torch.randn(2, t[k].shape[1], 1, 1)
    return k


def wrong_shape_text_encoder(t, h):
    k = _key(t, "lora_te_", "lora_up")
    t[k] = torch.randn(33, 2)
    return k


def rank_mismatch(t, h):
    k = _key(t, "attn2", "to_q.lora_up")
    t[k] = torch.randn(t[k].shape[0], 3)
    return k


def nan_value(t, h):
    k = _key(t, "unet.", "attn1.to_q.lora_A")
    t[k][0, 0] = float("nan")
    return k


def _alpha(value):
    def brk(t, h):
        k = _key(t, "attn1", "to_q.alpha")
        t[k] = torch.tensor(value)
        return k
    return brk


def rank_zero(t, h):
    layer = _key(t, "attn1", "to_q.lora_down").removesuffix(".lora_down.weight")
    t[f"{layer}.lora_down.weight"] = torch.zeros(0, t[f"{layer}.lora_down.weight"].shape[1])
    t[f"{layer}.lora_up.weight"] = torch.zeros(t[f"{layer}.lora_up.weight"].shape[0], 0)
    return f"{layer}.lora_down.weight"


def lokr_product(t, h):
    """Factors of a few hundred kB whose Kronecker product would be 60000 x 60000 (14 GB)."""
    layer = _layer(t, "proj_in.lokr_w1")
    t[f"{layer}.lokr_w1"] = torch.randn(250, 250)
    t[f"{layer}.lokr_w2_a"] = torch.randn(240, 2)
    t[f"{layer}.lokr_w2_b"] = torch.randn(2, 240)
    return layer


def loha_product(t, h):
    layer = _layer(t, "to_q.hada_w1_a")
    for w in ("w1", "w2"):
        t[f"{layer}.hada_{w}_a"] = torch.randn(60000, 2)
        t[f"{layer}.hada_{w}_b"] = torch.randn(2, 60000)
    return layer


def lokr_inner_mismatch(t, h):
    k = _key(t, "to_q.lokr_w2_b")
    t[k] = torch.randn(3, t[k].shape[1])
    return k


def _metadata(edit):
    def brk(t, h):
        h["lora_adapter_metadata"] = edit(json.loads(h["lora_adapter_metadata"]))
        return "lora_adapter_metadata"
    return brk


def _metadata_key(key, value):
    def brk(t, h):
        h["lora_adapter_metadata"] = json.dumps({**json.loads(h["lora_adapter_metadata"]), key: value})
        return key
    return brk


def bad_layout(t, h):
    h["diffpipe.fused_layout"] = json.dumps({"input_blocks.4.1.proj_in": 5})
    return "diffpipe.fused_layout"


CASES = {
    "wrong-shape": ("lora-comfyui", wrong_shape_comfyui),
    "wrong-shape-diffusers": ("lora-diffusers", wrong_shape_diffusers),
    "wrong-kernel": ("lora-kohya", wrong_kernel_kohya),
    "wrong-shape-text-encoder": ("lora-kohya", wrong_shape_text_encoder),
    "rank-mismatch": ("lora-kohya", rank_mismatch),
    "nan": ("lora-diffusers", nan_value),
    "inf-alpha": ("lora-kohya", _alpha(float("inf"))),
    "nan-alpha": ("lora-comfyui", _alpha(float("nan"))),
    "zero-alpha": ("lora-comfyui", _alpha(0.0)),
    "negative-alpha": ("lora-comfyui", _alpha(-3.0)),
    "two-element-alpha": ("lora-comfyui", _alpha([3.0, 3.0])),
    "rank-0": ("lora-kohya", rank_zero),
    "lokr-product-too-big": ("lokr-comfyui", lokr_product),
    "loha-product-too-big": ("loha-kohya", loha_product),
    "lokr-factors-disagree": ("lokr-kohya", lokr_inner_mismatch),
    "metadata-list": ("lora-diffusers", _metadata(lambda m: json.dumps(list(m)))),
    "metadata-deep": ("lora-diffusers", _metadata(lambda m: "[" * 100_000 + "]" * 100_000)),
    "metadata-not-json": ("lora-diffusers", _metadata(lambda m: "{unet.r: 2")),
    "alpha-pattern-string": ("lora-diffusers", _metadata_key("unet.alpha_pattern", "to_q")),
    "alpha-pattern-bad-regex": ("lora-diffusers", _metadata_key("unet.alpha_pattern", {"to_q(": 2.0})),
    "alpha-pattern-bad-value": ("lora-diffusers", _metadata_key("unet.alpha_pattern", {"to_q": "big"})),
    "metadata-two-element-alpha": ("lora-diffusers", _metadata_key("unet.lora_alpha", [2.0, 3.0])),
    "metadata-inf-alpha": ("lora-diffusers", _metadata_key("unet.lora_alpha", float("inf"))),
    "metadata-component-list": ("lora-diffusers", _metadata_key("text_encoder.lora_alpha", [1])),
    "fused-layout": ("lora-comfyui", bad_layout),
}


def _broken_file(good, brk, tmp_path):
    tensors = load_file(str(good))
    with safe_open(str(good), framework="pt") as f:
        header = dict(f.metadata() or {})
    key = brk(tensors, header)
    bad = tmp_path / f"broken [{good.stem}].safetensors"  # brackets: printed as written, not as markup
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(bad), metadata=header)
    return bad, key


def _import(source, out):
    return runner.invoke(app, ["import-lora", str(source), str(out), "--family", "sd"])


@pytest.mark.parametrize("case", list(CASES))
def test_broken_file_is_refused_naming_file_and_key(exported, tmp_path, case):
    good, brk = CASES[case]
    bad, key = _broken_file(exported[good], brk, tmp_path)
    out = tmp_path / "imported"
    result = _import(bad, out)
    assert result.exit_code == 1, f"{result.output}\n{result.exception!r}"
    assert "error: unexpected" not in result.output, result.output
    assert str(bad) in result.output and key in result.output, result.output
    assert not out.exists()


def _peft_broken(good, tmp_path, edit):
    folder = tmp_path / "peft [copy]"
    shutil.copytree(good, folder)
    weights = folder / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    key = edit(tensors, folder)
    save_file(tensors, str(weights))
    return folder, key


def _peft_shape(t, folder):
    k = _key(t, "attn1.to_q.lora_A")
    t[k] = torch.randn(2, t[k].shape[1] + 1)
    return k.removeprefix(PEFT_PREFIX)


def _peft_alpha(t, folder):
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": -2.0}))
    return "lora_alpha"


def _peft_config(text):
    def edit(t, folder):
        (folder / "adapter_config.json").write_text(text(json.loads((folder / "adapter_config.json").read_text())))
        return "adapter_config.json"
    return edit


PEFT_CASES = {
    "wrong-shape": _peft_shape,
    "negative-alpha": _peft_alpha,
    "config-deep": _peft_config(lambda cfg: "[" * 100_000 + "]" * 100_000),
    "config-unknown-field": _peft_config(lambda cfg: json.dumps({**cfg, "no_such_field": 1})),
}


@pytest.mark.parametrize("edit", list(PEFT_CASES.values()), ids=list(PEFT_CASES))
def test_broken_peft_folder_is_refused(exported, tmp_path, edit):
    folder, key = _peft_broken(exported["lora-peft"], tmp_path, edit)
    result = _import(folder, tmp_path / "imported")
    assert result.exit_code == 1, f"{result.output}\n{result.exception!r}"
    assert "error: unexpected" not in result.output, result.output
    assert str(folder) in result.output and key in result.output, result.output
    assert not (tmp_path / "imported").exists()


@pytest.mark.parametrize("good", ["lora-diffusers", "lora-comfyui", "lora-kohya", "lora-peft", "lokr-comfyui",
                                  "lokr-kohya", "loha-comfyui", "loha-kohya"])
def test_the_good_files_import(exported, tmp_path, good):
    """The files the broken ones are made from import (so each refusal above is for its one break)."""
    result = _import(exported[good], tmp_path / "imported")
    assert result.exit_code == 0, result.output


def test_local_model_is_checked_from_its_configs_alone(exported, tmp_path):
    """A local model's shapes come from its configs, the modules built on the meta device: with every
    weight file of the folder deleted, a good file imports and a wrong shape is still refused."""
    from diffpipe.export import import_lora

    folder = tmp_path / "model"
    get_family(ModelConfig(family="sd", flavor="tiny")).load_pipeline().save_pretrained(folder)
    weights = [p for p in folder.rglob("*") if p.suffix in (".safetensors", ".bin")]
    assert weights
    for p in weights:
        p.unlink()
    family = get_family(ModelConfig(family="sd", flavor="local", path=str(folder)))
    import_lora(exported["lora-kohya"], tmp_path / "good", family)
    bad, key = _broken_file(exported["lora-kohya"], wrong_shape_text_encoder, tmp_path)
    with pytest.raises(ValueError, match=re.escape(key)):
        import_lora(bad, tmp_path / "bad", family)
    bad, key = _broken_file(exported["loha-kohya"], loha_product, tmp_path)
    with pytest.raises(ValueError, match=re.escape(key)):
        import_lora(bad, tmp_path / "bad", family)
