"""Every export format, for every family: every key maps, the reference loader reproduces the trained delta.

One tiny family per module fixture; a LoRA with random ``up`` matrices and
alpha != rank (so a lost alpha shows) stands in for a trained adapter. The
expected weight deltas come from PEFT's own ``get_delta_weight`` on the
in-training model, independent of our conversion code.
"""

from __future__ import annotations

import copy
import json

import peft
import pytest
import torch
from diffusers import FluxPipeline
from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers
from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint
from peft.tuners.lora import LoraLayer
from safetensors import safe_open
from safetensors.torch import load_file

from diffpipe.config import LoraConfig, ModelConfig
from diffpipe.export import export_lora, import_lora
from diffpipe.export.convert import to_original
from diffpipe.export.keymaps import keymap_for_model
from diffpipe.export.original_io import read_original
from diffpipe.models import get_family
from diffpipe.paths import FORMATS
from diffpipe.training.adapter import (
    add_lora,
    apply_adapter,
    lora_state_dict,
    peft_config,
    save_adapter,
)

TOL = 1e-5
# Beyond the defaults: Flux's final modulation (stored with its halves swapped
# in the original) and the single blocks' output; SD's shortcut convs and the
# time embedding. Flux's ``proj_mlp`` stays out, so ``linear1`` is partly trained.
EXTRA_TARGETS = {"sd": ["conv_shortcut", "time_embedding.linear_1"], "flux": ["norm_out.linear", "proj_out"]}


def _forward_inputs(family, denoiser):
    g = torch.Generator().manual_seed(0)
    c = denoiser.config
    if family.name == "sd":
        x = torch.randn(2, c.in_channels, 16, 16, generator=g)
        return {"sample": x, "timestep": torch.tensor([10, 500]),
                "encoder_hidden_states": torch.randn(2, 7, c.cross_attention_dim, generator=g)}
    h = w = 4
    return {
        "hidden_states": torch.randn(1, h * w, c.in_channels, generator=g),
        "encoder_hidden_states": torch.randn(1, 5, c.joint_attention_dim, generator=g),
        "pooled_projections": torch.randn(1, c.pooled_projection_dim, generator=g),
        "timestep": torch.tensor([0.4]),
        "guidance": torch.tensor([1.0]),
        "img_ids": FluxPipeline._prepare_latent_image_ids(1, h, w, "cpu", torch.float32),
        "txt_ids": torch.zeros(5, 3),
    }


def _out(denoiser, inputs):
    with torch.no_grad():
        return denoiser(**inputs, return_dict=False)[0]


def _deltas(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Weight delta of every LoRA layer, computed by PEFT (the active adapter)."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, LoraLayer):
            (adapter,) = mod.active_adapters
            out[name.removeprefix("base_model.model.")] = mod.get_delta_weight(adapter).detach().float()
    return out


def _assert_deltas(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str):
    zero = {k for k, v in got.items() if k not in expected and v.abs().max() == 0}
    assert set(got) - zero == set(expected), f"{what}: modules differ: {sorted(set(got) ^ set(expected))[:5]}"
    for k, d in expected.items():
        diff = (got[k] - d).abs().max().item()
        assert diff <= TOL, f"{what}: {k} delta off by {diff:.2e}"


@pytest.fixture(scope="module", params=["sd", "flux"])
def trained(request, tmp_path_factory):
    name = request.param
    family = get_family(ModelConfig(family=name, flavor="tiny"))
    denoiser = family.load_denoiser()
    inputs = _forward_inputs(family, denoiser)
    base_out = _out(denoiser, inputs)
    targets = family.lora_targets(None) + EXTRA_TARGETS[name]
    lora_cfg = peft_config(LoraConfig(rank=4, alpha=6.0, targets=targets), targets)
    add_lora(denoiser, lora_cfg)
    g = torch.Generator().manual_seed(1)
    for pname, p in denoiser.named_parameters():
        if "lora_B" in pname:
            p.data = torch.randn(p.shape, generator=g) * 0.1
    root = tmp_path_factory.mktemp(f"export-{name}")
    meta = {"family": name, "flavor": "tiny", "step": 7, "epoch": 1}  # what training records
    save_adapter(root / "adapter", lora_state_dict(denoiser), lora_cfg, meta)
    result = export_lora(root / "adapter", root / "export", family, list(FORMATS))
    return {"family": family, "denoiser": denoiser, "inputs": inputs, "base_out": base_out,
            "trained_out": _out(denoiser, inputs), "deltas": _deltas(denoiser), "root": root,
            "files": result.files, "card": result.card}


def test_lora_changes_the_output(trained):
    assert (trained["trained_out"] - trained["base_out"]).abs().max() > 1e-3


# -- key maps against diffusers' single-file converters ------------------------------------------
def test_sd_key_map_matches_diffusers_single_file_converter():
    """Renaming the UNet to original names with our table, diffusers' LDM converter gives it back."""
    family = get_family(ModelConfig(family="sd", flavor="tiny"))
    unet = family.load_denoiser()
    keymap = keymap_for_model("sd", unet)
    keymap.check_covers(unet)
    ldm = {}
    for key, value in unet.state_dict().items():
        module, param = key.rsplit(".", 1)
        layer = keymap.by_module.get(module)
        if layer is None:  # norms: not LoRA-able, renamed by the converter's own rules
            continue
        ldm[f"model.diffusion_model.{layer.original}.{param}"] = value
    back = convert_ldm_unet_checkpoint(copy.copy(ldm), dict(unet.config))
    sd = unet.state_dict()
    mapped = {k for k in sd if k.rsplit(".", 1)[0] in keymap.by_module}
    assert mapped <= set(back), sorted(mapped - set(back))[:5]
    for k in mapped:
        assert torch.equal(back[k], sd[k]), k


def test_flux_key_map_matches_diffusers_single_file_converter():
    """On a FLUX.1-sized skeleton (meta device: shapes, no memory), fusing the transformer's
    weights with our table and running diffusers' BFL converter gives back every key and shape.

    The converter hard-codes FLUX.1's inner dim (3072), hence the full-size skeleton; values are
    checked by the kohya-converter test below, which runs on real tensors.
    """
    from diffusers import FluxTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    with torch.device("meta"):
        model = FluxTransformer2DModel(num_layers=1, num_single_layers=1, guidance_embeds=True)
    keymap = keymap_for_model("flux", model)
    keymap.check_covers(model)
    sd = model.state_dict()
    original = {}
    for layer in keymap.layers:
        for param in ("weight", "bias"):
            parts = [sd[f"{s.module}.{param}"][s.start : s.start + s.size] for s in layer.segments]
            original[f"{layer.original}.{param}"] = torch.cat(parts)
    # Norm scales are not LoRA targets (outside the table); named as in the BFL checkpoint.
    for stream, ours in (("img", ""), ("txt", "added_")):
        for qk in ("q", "k"):
            name = {"q": "query", "k": "key"}[qk]
            original[f"double_blocks.0.{stream}_attn.norm.{name}_norm.scale"] = \
                sd[f"transformer_blocks.0.attn.norm_{ours}{qk}.weight"]
    for qk, name in (("q", "query"), ("k", "key")):
        original[f"single_blocks.0.norm.{name}_norm.scale"] = sd[f"single_transformer_blocks.0.attn.norm_{qk}.weight"]
    back = convert_flux_transformer_checkpoint_to_diffusers(original)
    assert set(back) == set(sd), sorted(set(back) ^ set(sd))[:5]
    assert all(back[k].shape == sd[k].shape for k in sd)
    assert keymap.by_original["double_blocks.0.img_attn.qkv"].out_features == 9216
    assert keymap.by_original["single_blocks.0.linear1"].out_features == 21504


# -- per format: every key maps, reference loader reproduces the delta and the output -------------
def test_every_format_written_with_metadata_and_card(trained):
    files = trained["files"]
    assert set(files) == set(FORMATS)
    for fmt in ("diffusers", "comfyui", "kohya"):
        with safe_open(str(files[fmt]), framework="pt") as f:
            meta = f.metadata()
        base = json.loads(meta["diffpipe.base_model"])
        assert base["family"] == trained["family"].name and len(base["weights_sha256"]) == 64
        assert json.loads(meta["diffpipe.lora"])["alpha"] == 6.0
        assert json.loads(meta["diffpipe.training"]) == {"step": 7, "epoch": 1}
        assert len(meta["diffpipe.tensors_sha256"]) == 64
    with safe_open(str(files["kohya"]), framework="pt") as f:
        meta = f.metadata()
    assert meta["ss_network_dim"] == "4" and meta["ss_network_alpha"] == "6.0" and meta["ss_steps"] == "7"
    assert {"ss_base_model_version", "ss_training_started_at", "ss_num_train_images", "modelspec.architecture",
            "modelspec.title", "modelspec.resolution", "modelspec.sai_model_spec"} <= set(meta)
    card = trained["card"].read_text()
    assert all(fmt in card for fmt in FORMATS)


def test_diffusers_file_loads_in_pipeline_at_trained_strength(trained):
    family = trained["family"]
    pipe = family.load_pipeline()
    pipe.load_lora_weights(str(trained["files"]["diffusers"]))
    denoiser = getattr(pipe, family.denoiser_name)
    _assert_deltas(_deltas(denoiser), trained["deltas"], "diffusers/load_lora_weights")
    torch.testing.assert_close(_out(denoiser, trained["inputs"]), trained["trained_out"], rtol=1e-5, atol=1e-5)


def test_peft_folder_loads_with_peft(trained):
    family = trained["family"]
    model = peft.PeftModel.from_pretrained(family.load_denoiser(), str(trained["files"]["peft"]))
    _assert_deltas(_deltas(model), trained["deltas"], "peft/PeftModel.from_pretrained")
    torch.testing.assert_close(_out(model.base_model.model, trained["inputs"]), trained["trained_out"],
                               rtol=1e-5, atol=1e-5)


def _comfy_keys(keymap) -> set[str]:
    """Layer names ComfyUI's loader maps for a model: ``diffusion_model.<original>`` and ``lora_unet_<original>``."""
    names = set()
    for layer in keymap.layers:
        names |= {f"diffusion_model.{layer.original}", "lora_unet_" + layer.original.replace(".", "_")}
        if keymap.family == "sd":  # ComfyUI also maps kohya's diffusers-path names for SD
            names.add(layer.kohya)
    return names


@pytest.mark.parametrize("fmt", ["comfyui", "kohya"])
def test_original_name_formats_map_every_key(trained, fmt):
    keymap = keymap_for_model(trained["family"].name, trained["family"].load_denoiser())
    named, _, _ = read_original(trained["files"][fmt])
    assert set(named) <= _comfy_keys(keymap), sorted(set(named) - _comfy_keys(keymap))[:5]
    tensors = load_file(str(trained["files"][fmt]))
    assert all(f"{n}.alpha" in tensors for n in named), "every layer carries its alpha"


@pytest.mark.parametrize("fmt", ["comfyui", "kohya"])
def test_original_name_formats_load_with_diffusers_converters(trained, fmt):
    """SD: the stock pipeline's kohya loader; Flux: its kohya/ComfyUI converter (see the FLUX.1-size test)."""
    family = trained["family"]
    if family.name == "flux":
        pytest.skip("diffusers' Flux converter hard-codes FLUX.1 split sizes; checked at full size below")
    pipe = family.load_pipeline()
    tensors = load_file(str(trained["files"][fmt]))
    kwargs = {}
    if fmt == "comfyui":  # ComfyUI's own equivalence: diffusion_model.<path> == lora_unet_<path with _>
        renamed = {}
        for key, value in tensors.items():
            layer, _, suffix = key.removeprefix("diffusion_model.").partition(".lora_")
            if not suffix:
                layer, suffix = key.removeprefix("diffusion_model.").removesuffix(".alpha"), "alpha"
            else:
                suffix = "lora_" + suffix
            renamed["lora_unet_" + layer.replace(".", "_") + "." + suffix] = value
        tensors = renamed
        kwargs["unet_config"] = pipe.unet.config  # original block numbering -> diffusers
    pipe.load_lora_weights(tensors, **kwargs)
    _assert_deltas(_deltas(pipe.unet), trained["deltas"], f"{fmt}/load_lora_weights")
    torch.testing.assert_close(_out(pipe.unet, trained["inputs"]), trained["trained_out"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["diffusers", "peft", "comfyui", "kohya"])
def test_import_round_trip(trained, fmt, tmp_path):
    family = trained["family"]
    result = import_lora(trained["files"][fmt], tmp_path / "adapter", family)
    assert result.format == fmt
    model = apply_adapter(family.load_denoiser(), tmp_path / "adapter")
    _assert_deltas(_deltas(model), trained["deltas"], f"{fmt}/import-lora")
    torch.testing.assert_close(_out(model, trained["inputs"]), trained["trained_out"], rtol=1e-5, atol=1e-5)


def test_merged_pipeline_equals_base_plus_lora(trained):
    family = trained["family"]
    merged = family.pipeline_class.from_pretrained(str(trained["files"]["merged"]))
    denoiser = getattr(merged, family.denoiser_name)
    base = family.load_denoiser().state_dict()
    for key, value in denoiser.state_dict().items():
        module = key.removesuffix(".weight")
        expected = base[key] + trained["deltas"][module] if module in trained["deltas"] else base[key]
        assert (value - expected).abs().max() <= TOL, key
    torch.testing.assert_close(_out(denoiser, trained["inputs"]), trained["trained_out"], rtol=1e-4, atol=1e-5)


def test_import_rejects_unmapped_layer(trained, tmp_path):
    from safetensors.torch import save_file

    tensors = load_file(str(trained["files"]["comfyui"]))
    tensors["diffusion_model.no_such_block.lora_down.weight"] = torch.zeros(4, 8)
    tensors["diffusion_model.no_such_block.lora_up.weight"] = torch.zeros(8, 4)
    save_file(tensors, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match="no_such_block"):
        import_lora(tmp_path / "bad.safetensors", tmp_path / "out", trained["family"])


# -- Flux at FLUX.1 size: diffusers' kohya / ComfyUI converter as the reference ------------------
@pytest.mark.parametrize("fmt", ["comfyui", "kohya"])
def test_flux1_size_export_reads_back_with_diffusers_converter(fmt):
    """Our fused qkv / linear1 (block-structured) read by ``_convert_kohya_flux_lora_to_diffusers``.

    A FLUX.1-dev-sized transformer (1 double + 1 single block) on the meta
    device gives the shapes; the LoRA tensors themselves are small (rank 2).
    Deltas are compared through random probes: ``delta @ x``.
    """
    from diffusers import FluxTransformer2DModel

    from diffpipe.export.convert import Lora
    from diffpipe.export.keymaps.base import kohya_name

    with torch.device("meta"):
        model = FluxTransformer2DModel(num_layers=1, num_single_layers=1, guidance_embeds=True)
    keymap = keymap_for_model("flux", model)
    targets = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
               "attn.to_out.0", "ff.net.2", "norm1.linear", "norm_out.linear", "proj_out", "x_embedder"]
    g = torch.Generator().manual_seed(0)
    mods = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets):
            mods[name] = Lora(torch.randn(2, m.in_features, generator=g), torch.randn(m.out_features, 2, generator=g),
                              3.0 if "to_q" in name else 6.0)  # one differing scale: folded into its up block
    loras, _ = to_original(mods, keymap)
    sd = {}
    for layer, lora in loras.items():
        name = f"diffusion_model.{layer.original}" if fmt == "comfyui" else layer.kohya
        sd |= {f"{name}.lora_down.weight": lora.down, f"{name}.lora_up.weight": lora.up,
               f"{name}.alpha": torch.tensor(lora.alpha)}
    assert all(layer.kohya == kohya_name(layer.original) for layer in keymap.layers)
    converted = _convert_kohya_flux_lora_to_diffusers(sd)
    got = {}
    for key, down in converted.items():
        if key.endswith(".lora_A.weight"):
            module = key.removeprefix("transformer.").removesuffix(".lora_A.weight")
            got[module] = (down, converted[key.replace("lora_A", "lora_B")])
    assert set(mods) <= set(got), sorted(set(mods) - set(got))[:5]
    for module, (down, up) in got.items():
        x = torch.randn(down.shape[1], 3, generator=g)
        result = up @ (down @ x)  # the converter folds alpha / rank into the tensors
        expected = mods[module].scale * mods[module].up @ (mods[module].down @ x) if module in mods else 0 * result
        assert (result - expected).abs().max() <= 1e-4 * max(1.0, expected.abs().max().item()), module


def test_import_of_fused_lora_without_layout_is_exact(trained, tmp_path):
    """A fused LoRA from another tool (no block layout recorded): each part shares ``down``; still exact."""
    from safetensors.torch import save_file

    src = trained["files"]["kohya"]
    save_file(load_file(str(src)), str(tmp_path / "foreign.safetensors"))  # same tensors, no diffpipe header
    import_lora(tmp_path / "foreign.safetensors", tmp_path / "adapter", trained["family"])
    model = apply_adapter(trained["family"].load_denoiser(), tmp_path / "adapter")
    _assert_deltas(_deltas(model), trained["deltas"], "kohya without layout/import-lora")


def test_cli_export_and_import_lora(trained, tmp_path):
    """``diffpipe export ADAPTER --format a,b`` (family read from the adapter) and ``diffpipe import-lora``."""
    from typer.testing import CliRunner

    from diffpipe.cli import app

    runner = CliRunner()
    name = trained["family"].name
    result = runner.invoke(app, ["export", str(trained["root"] / "adapter"), "--format", "comfyui,kohya",
                                 "--out", str(tmp_path / "exp")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "exp" / "comfyui_lora.safetensors").exists() and (tmp_path / "exp" / "README.md").exists()
    bad = runner.invoke(app, ["export", str(trained["root"] / "adapter"), "--format", "onnx"])
    assert bad.exit_code == 2 and "onnx" in bad.output
    result = runner.invoke(app, ["import-lora", str(tmp_path / "exp" / "kohya_lora.safetensors"),
                                 str(tmp_path / "imported"), "--family", name])
    assert result.exit_code == 0, result.output
    model = apply_adapter(trained["family"].load_denoiser(), tmp_path / "imported")
    _assert_deltas(_deltas(model), trained["deltas"], "cli import-lora")


def test_cli_exports_a_deepspeed_checkpoint(trained, tmp_path):
    """``diffpipe export RUN/train/checkpoints/step-N``: the LoRA tensors of a DeepSpeed checkpoint."""
    import yaml
    from typer.testing import CliRunner

    from diffpipe.cli import app

    family = trained["family"]
    run = tmp_path / "run"
    ckpt = run / "train" / "checkpoints" / "step-000007"
    ckpt.mkdir(parents=True)
    # DeepSpeed saves the module state dict (frozen weights excluded) and our client state.
    module = {k: v for k, v in trained["denoiser"].state_dict().items() if "lora_" in k}
    torch.save({"module": module, "step": 7}, ckpt / "mp_rank_00_model_states.pt")
    targets = family.lora_targets(None) + EXTRA_TARGETS[family.name]
    cfg = {"output_dir": str(run), "datasets": [{"name": "d", "path": str(tmp_path)}],
           "model": {"family": family.name}, "train": {"lora": {"rank": 4, "alpha": 6.0, "targets": targets}}}
    (run / "resolved-config.yaml").write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(app, ["export", str(ckpt), "--format", "comfyui"])
    assert result.exit_code == 0, result.output
    exported = run / "export" / "step-000007" / "comfyui_lora.safetensors"
    import_lora(exported, tmp_path / "adapter", family)
    model = apply_adapter(family.load_denoiser(), tmp_path / "adapter")
    _assert_deltas(_deltas(model), trained["deltas"], "deepspeed checkpoint export")
