"""Base LoRAs (``model.base_loras``): folded into the frozen denoiser for training, left out of the export.

One tiny training run over a diffusers-format base LoRA: its exported LoRA, loaded beside the base LoRA file
into the stock pipeline (``load_lora_weights``, two adapters), reproduces training's denoiser output. The
base LoRA's formats (diffusers, kohya, ComfyUI, a LoKr) are checked at the fold: the folded weights equal
the base plus PEFT's own delta of the same adapter, at the configured scale.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from stage_cli import in_process

from diffpipe.config import LoraConfig, ModelConfig, parse_config
from diffpipe.export import export_lora
from diffpipe.export.base_loras import prepare_base_loras
from diffpipe.families import get_family
from diffpipe.paths import RunPaths
from diffpipe.stages import stage_digest
from diffpipe.training import load
from diffpipe.training.adapter import add_lora, apply_adapter, lora_state_dict, peft_config, save_adapter
from diffpipe.training.base_loras import BaseDeltas

SCALE = 0.7


def _base_adapter(folder, kind: str, seed: int):
    """A random nonzero adapter on the tiny UNet, saved as training saves one; returns the family."""
    family = get_family(ModelConfig(family="sd", flavor="tiny"))
    targets = family.lora_targets(None)
    options = {"lokr_factor": 2} if kind == "lokr" else {}
    cfg = peft_config(LoraConfig(kind=kind, rank=4, alpha=6.0, targets=targets, **options), targets)
    unet = family.load_denoiser()
    add_lora(unet, cfg)
    g = torch.Generator().manual_seed(seed)
    for name, p in unet.named_parameters():
        if "lora_" in name or "lokr_" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.05
    save_adapter(folder, lora_state_dict(unet), cfg, {"family": "sd", "flavor": "tiny"})
    return family


@pytest.fixture(scope="module")
def base_files(tmp_path_factory):
    """The same LoRA as diffusers, kohya and ComfyUI files, and a LoKr as a ComfyUI file; by case name."""
    root = tmp_path_factory.mktemp("base-loras")
    family = _base_adapter(root / "lora", "lora", 1)
    lora = export_lora(root / "lora", root / "lora-export", family, ["diffusers", "kohya", "comfyui"]).files
    _base_adapter(root / "lokr", "lokr", 2)
    lokr = export_lora(root / "lokr", root / "lokr-export", family, ["comfyui"]).files
    return {"diffusers": (lora["diffusers"], root / "lora"), "kohya": (lora["kohya"], root / "lora"),
            "comfyui": (lora["comfyui"], root / "lora"), "lokr-comfyui": (lokr["comfyui"], root / "lokr")}


def _peft_deltas(adapter_dir) -> dict[str, torch.Tensor]:
    """PEFT's own delta of every adapted module (the reference the fold must equal)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    family = get_family(ModelConfig(family="sd", flavor="tiny"))
    model = apply_adapter(family.load_denoiser(), adapter_dir)
    return {name.removeprefix("base_model.model."): m.get_delta_weight("default").detach()
            for name, m in model.named_modules() if isinstance(m, BaseTunerLayer)}


@pytest.mark.parametrize("case", ["diffusers", "kohya", "comfyui", "lokr-comfyui"])
def test_fold_equals_peft_delta(base_files, case, tmp_path):
    """Each format, read by import-lora's reader and folded at scale 0.7, adds PEFT's delta x 0.7."""
    file, adapter_dir = base_files[case]
    model_cfg = ModelConfig(family="sd", flavor="tiny", base_loras=[{"path": str(file), "scale": SCALE}])
    family = get_family(model_cfg)
    folders = prepare_base_loras(family.cfg, family, tmp_path)
    plain, folded = family.load_denoiser(), family.load_denoiser()
    BaseDeltas.read(folders).fold_all(folded)
    expected = _peft_deltas(adapter_dir)
    weights = dict(plain.named_modules())
    assert expected
    for name, module in folded.named_modules():
        if name in expected:
            got = module.weight - weights[name].weight
            ref = SCALE * expected[name].reshape(got.shape)
            assert (got - ref).abs().max() <= 1e-5 * (1 + ref.abs().max()), name
        elif hasattr(module, "weight") and isinstance(module.weight, torch.Tensor):
            assert torch.equal(module.weight, weights[name].weight), f"{name} changed without a base LoRA"


def test_digest_follows_content_and_scale(base_files, tmp_path):
    """The train and sample digests change with the base LoRA's bytes (same path) and scale; the caches'
    do not (the base LoRAs touch the denoiser only)."""
    file = tmp_path / "base.safetensors"
    file.write_bytes(base_files["diffusers"][0].read_bytes())

    def digests(scale):
        cfg = parse_config({"output_dir": str(tmp_path / "run"), "datasets": [{"name": "d", "path": str(tmp_path / "data")}],
                            "model": {"family": "sd", "base_loras": [{"path": str(file), "scale": scale}]}})
        return {s: stage_digest(cfg, s) for s in ("cache", "train", "sample")}

    before = digests(1.0)
    assert digests(0.5)["train"] != before["train"]
    file.write_bytes(base_files["kohya"][0].read_bytes())  # same path, other content
    after = digests(1.0)
    assert after["train"] != before["train"] and after["sample"] != before["sample"]
    assert after["cache"] == before["cache"] == digests(0.5)["cache"]


def _inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 4, 8, 8, generator=g), torch.tensor([700, 100]),
            torch.randn(2, 77, 32, generator=g))


def test_trained_over_base_lora_reproduces_in_stock_pipeline(tiny_run, base_files, tmp_path):
    """Train over a base LoRA, export without it; the stock pipeline with both files loaded gives training's
    denoiser output. Without the base LoRA it does not (the trained LoRA alone is not the trained model)."""
    base_file = base_files["diffusers"][0]
    cfg_file = tiny_run.clone(tmp_path, epochs=1)
    cfg = yaml.safe_load(cfg_file.read_text())
    cfg["model"] = {"base_loras": [{"path": str(base_file), "scale": SCALE}]}
    cfg_file.write_text(yaml.safe_dump(cfg))
    result = in_process("train", "-c", str(cfg_file))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "base LoRA(s) folded" in result.stdout + result.stderr
    paths = RunPaths(tmp_path / "run")
    parsed = parse_config(cfg)
    family = get_family(parsed.model)
    exported = export_lora(paths.adapter_dir, tmp_path / "export", family, ["diffusers"], config=parsed)
    card = exported.card.read_text()
    assert "## Base LoRAs" in card and str(base_file) in card

    folders = prepare_base_loras(family.cfg, family, paths.root)
    trained = load.load_denoiser(family, parsed.train, torch.device("cpu"), base=BaseDeltas.read(folders)).module
    apply_adapter(trained, paths.adapter_dir)
    pipe = family.load_pipeline()
    pipe.load_lora_weights(str(base_file), adapter_name="base")
    pipe.load_lora_weights(str(exported.files["diffusers"]), adapter_name="trained")
    pipe.set_adapters(["base", "trained"], adapter_weights=[SCALE, 1.0])
    x, t, text = _inputs()
    with torch.no_grad():
        want = trained(x, t, encoder_hidden_states=text).sample
        got = pipe.unet(x, t, encoder_hidden_states=text).sample
        pipe.set_adapters(["trained"], adapter_weights=[1.0])
        alone = pipe.unet(x, t, encoder_hidden_states=text).sample
    err = (got - want).abs().max().item()
    rel = err / want.abs().max().item()
    print(f"exported-over-base-LoRA reproduction: max abs {err:.3g}, relative {rel:.3g}; "
          f"without the base LoRA: max abs {(alone - want).abs().max().item():.3g}")
    assert rel <= 1e-5, (err, rel)
    assert (alone - want).abs().max() > 100 * err + 1e-4


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in [*model.named_parameters(), *model.named_buffers()]}


@pytest.mark.parametrize("base_weights", ["auto", "fp8"])
def test_streamed_fold_equals_whole_load_then_fold(base_weights, tmp_path):
    """A streamed bf16 load folds each weight as it is read, before fp8 stores it: the same model as loading
    whole, folding, then quantising; and not the model without the base LoRA."""
    family = get_family(ModelConfig(family="flux"))
    family.load_denoiser().save_pretrained(tmp_path / "model" / family.streamed_denoiser()[1])
    targets = family.lora_targets(None)
    cfg = peft_config(LoraConfig(rank=4, alpha=6.0, targets=targets), targets)
    den = family.load_denoiser()
    add_lora(den, cfg)
    g = torch.Generator().manual_seed(3)
    for name, p in den.named_parameters():
        if "lora_" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.05
    save_adapter(tmp_path / "base", lora_state_dict(den), cfg, {"family": "flux", "flavor": "tiny"})
    local = get_family(ModelConfig(family="flux", flavor="local", path=str(tmp_path / "model"), dtype="bfloat16"))
    from diffpipe.config import TrainConfig
    from diffpipe.training import precision

    tc = TrainConfig(base_weights=base_weights, precision="bf16")
    assert load.why_whole(local) is None

    def loaded(streamed: bool, base: bool):
        deltas = BaseDeltas.read([(tmp_path / "base", SCALE)]) if base else None
        if streamed:
            out = load.load_denoiser(local, tc, torch.device("cpu"), base=deltas)
            model, quantised = out.module, out.quantised
        else:
            model, quantised = local.load_denoiser(), False
            if deltas:
                deltas.fold_all(model)
        torch.manual_seed(0)  # the trained LoRA goes in before quantisation picks its layers, as in training
        add_lora(model, peft_config(tc.lora, local.lora_targets(tc.lora.targets)))
        precision.prepare_denoiser(model, tc, quantise=not quantised)
        return _state(model)

    whole, streamed, plain = loaded(False, True), loaded(True, True), loaded(True, False)
    assert whole.keys() == streamed.keys()
    for key, value in whole.items():
        assert value.dtype == streamed[key].dtype and torch.equal(value.view(torch.uint8) if value.element_size() == 1
                                                                 else value, streamed[key].view(torch.uint8)
                                                                 if value.element_size() == 1 else streamed[key]), key
    changed = [k for k in whole if not torch.equal(whole[k].float(), plain[k].float())]
    assert any("base_layer.weight" in k for k in changed)
    assert all("weight" in k for k in changed), changed
