"""The export's verify step: every file read back by its consumer's rules, the run failed on a bad one.

A tiny SD adapter with alpha != rank (a lost alpha shows) on the denoiser and on the text encoder
stands in for a trained one; each planted fault (a key map naming a layer ComfyUI has no weight
for, the diffusers file's CLIP names as transformers 5 writes them, a strength lost on the way, a
PEFT tensor for no module) must fail the export naming the file and the keys.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from peft import get_peft_model_state_dict, inject_adapter_in_model
from safetensors.torch import load_file, save_file
from tiny_adapters import sd_adapter
from typer.testing import CliRunner

from diffpipe.cli import app
from diffpipe.config import LoraConfig, ModelConfig
from diffpipe.export import api, comfy_rules, diffusers_format, export_lora, lycoris, verify_checks
from diffpipe.export.keymaps import KeyMap
from diffpipe.export.verify import VERIFY_NAME, ExportVerifyError, verify_exports
from diffpipe.families import get_family
from diffpipe.training.adapter import add_lora, lora_state_dict, peft_config, save_adapter

FORMATS = ["diffusers", "peft", "comfyui", "kohya"]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A tiny-SD adapter folder: the UNet's LoRA and the text encoder's, both alpha 6 at rank 4."""
    return sd_adapter(tmp_path_factory.mktemp("verify") / "adapter")


def test_a_good_export_verifies(adapter, tmp_path):
    family, folder = adapter
    result = export_lora(folder, tmp_path / "export", family, FORMATS)
    report = json.loads(result.verify.read_text())
    assert result.verify == tmp_path / "export" / VERIFY_NAME
    assert report["ok"], report
    assert set(report["files"]) == {"pytorch_lora_weights.safetensors", "peft", "comfyui_lora.safetensors",
                                    "kohya_lora.safetensors"}
    n_unet = sum(k.endswith("lora_A.weight") for k in load_file(str(folder / "adapter_model.safetensors")))
    card = result.card.read_text()
    for row in ("| ComfyUI | `comfyui_lora.safetensors` |", "| diffusers | `pytorch_lora_weights.safetensors` |",
                "| kohya / sd-scripts, A1111 / Forge | `kohya_lora.safetensors` |", "| PEFT | `peft` |"):
        assert row in card.split("## Which file for which tool")[1], row
    for name, entry in report["files"].items():  # every trained module placed, in every file
        assert entry["problems"] == [] and entry["placed"] >= n_unet, (name, entry)


def _renamed_layer(keymap: KeyMap) -> KeyMap:
    """The table with a trained layer's names wrong (the first ``to_q``): a layer ComfyUI has no weight for."""
    layers = list(keymap.layers)
    i = next(i for i, la in enumerate(layers) if la.modules[0].endswith("attn1.to_q"))
    layers[i] = dataclasses.replace(layers[i], original="no_such.layer", kohya="lora_unet_no_such_layer", comfy="")
    return KeyMap(keymap.family, layers, keymap.peft_names)


def test_a_planted_bad_key_map_fails_the_export_naming_file_and_keys(adapter, tmp_path, monkeypatch):
    family, folder = adapter
    real = api.keymap_for_model
    monkeypatch.setattr(api, "keymap_for_model", lambda name, model: _renamed_layer(real(name, model)))
    with pytest.raises(ExportVerifyError) as err:
        export_lora(folder, tmp_path / "export", family, ["comfyui", "kohya"])
    message = str(err.value)
    assert "comfyui_lora.safetensors" in message and "diffusion_model.no_such.layer" in message
    assert "kohya_lora.safetensors" in message and "lora_unet_no_such_layer" in message
    report = json.loads((tmp_path / "export" / VERIFY_NAME).read_text())
    assert not report["ok"] and not report["files"]["comfyui_lora.safetensors"]["ok"]


def test_diffusers_clip_names_comfyui_drops_fail_the_export(adapter, tmp_path, monkeypatch):
    """transformers 5's CLIP paths (``text_encoder.encoder.layers...``): diffusers loads them, ComfyUI drops them."""
    family, folder = adapter
    monkeypatch.setattr(diffusers_format, "clip_paths_as_transformers4", lambda sd: sd)
    with pytest.raises(ExportVerifyError) as err:
        export_lora(folder, tmp_path / "export", family, ["diffusers"])
    assert "pytorch_lora_weights.safetensors" in str(err.value)
    assert "ComfyUI's diffusers mapping drops" in str(err.value)
    assert "text_encoder.encoder.layers.0.self_attn.q_proj" in str(err.value)


def test_a_lost_strength_fails_the_export(adapter, tmp_path, monkeypatch):
    """The diffusers file written without its scale folded in (alpha 6 read as alpha = rank)."""
    family, folder = adapter
    monkeypatch.setattr(api, "fold_scale", lambda sd, cfg: (sd, dataclasses.replace(cfg, lora_alpha=cfg.r)))
    with pytest.raises(ExportVerifyError) as err:
        export_lora(folder, tmp_path / "export", family, ["diffusers"])
    assert "pytorch_lora_weights.safetensors" in str(err.value)
    for part in ("", "text_encoder/"):  # every trained layer of each part
        trained = sum(k.endswith("lora_A.weight") for k in load_file(str(folder / part / "adapter_model.safetensors")))
        assert f"{trained} layer(s) at another strength than trained" in str(err.value)


def test_a_peft_tensor_for_no_module_fails_the_export(adapter, tmp_path, monkeypatch):
    family, folder = adapter
    real = api.export_peft

    def with_stray(state_dict, *args, **kwargs):
        return real({**state_dict, "no_such.lora_A.weight": torch.zeros(4, 8)}, *args, **kwargs)

    monkeypatch.setattr(api, "export_peft", with_stray)
    with pytest.raises(ExportVerifyError) as err:
        export_lora(folder, tmp_path / "export", family, ["peft"])
    assert "peft" in str(err.value) and "no_such.lora_A" in str(err.value)


def test_the_export_command_exits_1_on_a_failed_verify(adapter, tmp_path, monkeypatch):
    family, folder = adapter
    real = api.keymap_for_model
    monkeypatch.setattr(api, "keymap_for_model", lambda name, model: _renamed_layer(real(name, model)))
    result = CliRunner().invoke(app, ["export", str(folder), "--out", str(tmp_path / "out"), "-f", "comfyui"])
    assert result.exit_code == 1, result.output
    assert "comfyui_lora.safetensors" in result.output and "diffusion_model.no_such.layer" in result.output


def test_a_local_model_is_verified_from_its_configs_alone(adapter, tmp_path):
    """A local model's denoiser and text encoder are built from their configs on the meta device: with
    every weight file of the folder deleted, the files verify, and a planted fault still fails."""
    family, folder = adapter
    result = export_lora(folder, tmp_path / "export", family, FORMATS)
    model = tmp_path / "model"
    family.load_pipeline().save_pretrained(model)
    for p in [p for p in model.rglob("*") if p.suffix in (".safetensors", ".bin")]:
        p.unlink()
    local = get_family(ModelConfig(family="sd", flavor="local", path=str(model)))
    report = verify_exports(result.files, local, folder)
    assert report.ok, report.message()
    assert [c.placed for c in report.checks] == json_placed(result.verify)
    stray = tmp_path / "stray.safetensors"  # the diffusers file with one module renamed
    tensors = load_file(str(result.files["diffusers"]))
    key = next(k for k in tensors if k.startswith("unet.") and k.endswith("lora_A.weight"))
    tensors[key.replace("unet.", "unet.no_such.", 1)] = tensors.pop(key)
    save_file(tensors, str(stray))
    report = verify_exports({"diffusers": stray}, local, folder)
    assert not report.ok and "unet.no_such." in report.message()


def json_placed(path) -> list[int]:
    return [entry["placed"] for entry in json.loads(path.read_text())["files"].values()]


def test_each_expert_of_a_two_expert_run_verifies(tmp_path):
    """Wan 2.2 A14B with ``model.expert: both``: one diffusers file and one PEFT folder per expert, each
    read into its own expert (the tiny denoiser holds both)."""
    family = get_family(ModelConfig(family="wan", flavor="tiny", variant="2.2-a14b", expert="both"))
    experts = family.load_denoiser()
    targets = family.lora_targets(None)
    cfg = peft_config(LoraConfig(rank=4, alpha=6.0, targets=targets), targets)
    inject_adapter_in_model(cfg, experts)
    save_adapter(tmp_path / "adapter", get_peft_model_state_dict(experts), cfg, {"family": "wan", "flavor": "tiny"})
    result = export_lora(tmp_path / "adapter", tmp_path / "export", family, ["diffusers", "peft"])
    report = json.loads(result.verify.read_text())
    assert report["ok"] and len(report["files"]) == 4, report
    assert len({entry["placed"] for entry in report["files"].values()}) == 1  # the same modules in each


@pytest.fixture(scope="module", params=["lokr", "loha"])
def product_adapter(request, tmp_path_factory):
    """A tiny-SD LoKr or LoHa adapter (alpha 3 at rank 2: scale 1.5, so a lost scale shows), every tensor nonzero."""
    family = get_family(ModelConfig(family="sd", flavor="tiny"))
    targets = ["to_q", "to_k", "to_v", "to_out.0"]
    options = {"lokr_factor": 2} if request.param == "lokr" else {}
    cfg = peft_config(LoraConfig(kind=request.param, rank=2, alpha=3.0, targets=targets, **options), targets)
    unet = family.load_denoiser()
    add_lora(unet, cfg)
    g = torch.Generator().manual_seed(1)
    for p in unet.parameters():
        if p.requires_grad:  # LoKr's w2 and LoHa's second pair start at zero
            p.data += torch.randn(p.shape, generator=g) * 0.2
    folder = tmp_path_factory.mktemp(f"verify-{request.param}") / "adapter"
    save_adapter(folder, lora_state_dict(unet), cfg, {"family": "sd", "flavor": "tiny", "step": 3})
    return family, folder


def test_a_lycoris_export_verifies_its_strength(product_adapter, tmp_path):
    family, folder = product_adapter
    result = export_lora(folder, tmp_path / "export", family, ["comfyui", "kohya"])
    assert json.loads(result.verify.read_text())["ok"]
    # The probe arithmetic against the whole delta ComfyUI forms (comfy_rules.lycoris_patches), per layer.
    tensors = load_file(str(result.files["comfyui"]))
    layers, _ = verify_checks._layer_tensors(tensors)
    for name, make in comfy_rules.lycoris_patches(tensors).items():
        parts = layers[name]
        x = verify_checks.probe(verify_checks._in_features(parts))
        n_out = verify_checks.product_applied(parts, 1.0, x).shape[0]
        whole = make((n_out, x.shape[0])).double() @ x
        assert not verify_checks.differs(verify_checks.product_applied(parts, 1.0, x), whole), name


def test_a_lycoris_file_at_another_strength_fails_the_export(product_adapter, tmp_path, monkeypatch):
    """#41: LoKr / LoHa files written without their alpha / rank folded in (ComfyUI then applies 1.0, not 1.5)
    were passed on placement alone; the delta ComfyUI's LyCORIS arithmetic applies is now compared on probes."""
    family, folder = product_adapter
    monkeypatch.setattr(lycoris.Product, "folded", lambda self: self.tensors)
    with pytest.raises(ExportVerifyError) as err:
        export_lora(folder, tmp_path / "export", family, ["comfyui", "kohya"])
    message = str(err.value)
    assert "comfyui_lora.safetensors" in message and "kohya_lora.safetensors" in message
    assert "layer(s) at another strength than trained" in message and "attn1_to_q" in message, message


def test_a_merged_folder_without_the_lora_fails_the_export(adapter, tmp_path, monkeypatch):
    """#41: the merged folder is read back tensor by tensor: a trained layer whose saved weight is not base +
    trained delta (here: PEFT's merge of linear layers planted as a no-op, so their base is saved) fails the export."""
    from peft.tuners.lora.layer import Linear

    family, folder = adapter
    good = export_lora(folder, tmp_path / "good", family, ["merged"])
    entry = json.loads(good.verify.read_text())["files"]["merged"]
    assert entry["ok"] and entry["placed"] > 0, entry
    monkeypatch.setattr(Linear, "merge", lambda self, *a, **k: None)
    with pytest.raises(ExportVerifyError) as err:
        export_lora(folder, tmp_path / "export", family, ["merged"])
    assert "merged" in str(err.value) and "differ from base + trained delta" in str(err.value), str(err.value)
    assert "attn1.to_q" in str(err.value)
