"""ComfyUI fp8-scaled single files as the base denoiser (``model.single_files``; diffpipe.models.comfy_fp8).

Each case writes a tiny model's denoiser in that layout (tests/comfy_fp8_files.py): Z-Image in its original
names with fused ``qkv`` (split by diffusers' converter) and a scale per output row; Qwen-Image, whose original
names are diffusers', with one scale per tensor. The reference is the model the file holds: the same tensors
with each quantised weight dequantised (codes * scale) in float32, written as an ordinary single file and
loaded through the ordinary path.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from comfy_fp8_files import write_fp8_scaled, zimage_original
from safetensors.torch import load_file, save_file
from stage_cli import rendezvous

from diffpipe.config import ModelConfig, TrainConfig, parse_config
from diffpipe.export.metadata import denoiser_fingerprint
from diffpipe.families import get_family
from diffpipe.models.casting import ScaledFp8Linear, dequantise_fp8
from diffpipe.training import precision

CASES = {"zimage": True, "qwenimage": False}  # family -> a scale per row (else one per tensor)


def _embedder(key: str) -> bool:
    """Layers the written files keep in 16/32 bits, as published fp8-scaled files keep their embedders."""
    return "embed" in key


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    fam = request.param
    with pytest.MonkeyPatch.context() as mp:
        root = tmp_path_factory.mktemp(f"comfy-{fam}")
        mp.setenv("DIFFPIPE_CACHE", str(root / "cache"))
        tiny = get_family(ModelConfig(family=fam, flavor="tiny"))
        folder = root / "model"
        tiny.load_pipeline().save_pretrained(folder)
        for f in (folder / "transformer").glob("*.safetensors"):
            f.unlink()
        denoiser = tiny.load_denoiser()
        state = denoiser.state_dict()
        original = zimage_original(state) if fam == "zimage" else state
        held = write_fp8_scaled(original, root / "fp8_scaled.safetensors", per_row=CASES[fam], keep=_embedder)
        save_file(held, str(root / "held.safetensors"))

        def local(file: str):
            return get_family(ModelConfig(family=fam, flavor="local", path=str(folder),
                                          single_files={"transformer": str(root / file)}))

        yield {"fam": fam, "tiny": tiny, "denoiser": denoiser, "comfy": local("fp8_scaled.safetensors"),
               "held": local("held.safetensors"), "root": root, "local": local, "original": original}


def test_quantised_layers_are_the_files_codes_and_scales_exactly(case):
    fp8, held = case["comfy"].load_denoiser(), case["held"].load_denoiser()
    ref = dict(held.named_modules())
    layers = {n: m for n, m in fp8.named_modules() if isinstance(m, ScaledFp8Linear)}
    quantised = {n for n, m in held.named_modules() if isinstance(m, torch.nn.Linear) and not _embedder(n)}
    assert set(layers) == quantised
    for name, layer in layers.items():
        assert layer.weight.dtype == torch.uint8 and layer.weight_scale.dtype == torch.int32
        # float32 scales kept as the file has them: the dequantised weight is codes * scale, bit for bit
        assert torch.equal(dequantise_fp8(layer.weight, layer.weight_scale, torch.float32), ref[name].weight), name
    want = held.state_dict()
    have = fp8.state_dict()
    assert set(have) == set(want) - {f"{n}.weight" for n in layers}
    for key, value in have.items():
        assert value.dtype == want[key].dtype and torch.equal(value, want[key]), key


def _batch(family):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        vae, encoders = family.load_vae(), family.load_text_encoders()
        side = 2 * family.pixel_multiple
        latents = family.encode_pixels(vae, torch.rand(2, 3, 1, side, side, generator=g) * 2 - 1)
        return latents, family.encode_text(encoders, ["a red square", "two dogs on grass"])


def test_the_denoiser_predicts_what_the_file_holds_and_near_the_unquantised_model(case):
    latents, text = _batch(case["tiny"])

    def loss(model):
        with torch.no_grad():
            return case["tiny"].loss(model, latents, text, torch.Generator().manual_seed(3))

    fp8, held, full = loss(case["comfy"].load_denoiser()), loss(case["held"].load_denoiser()), loss(case["denoiser"])
    assert torch.allclose(fp8, held, rtol=1e-5, atol=1e-7)
    assert torch.allclose(fp8, full, rtol=0.05), (fp8, full)


def test_fp8_base_weights_keep_the_files_layers_and_quantise_the_rest(case):
    den = case["comfy"].load_denoiser().requires_grad_(False)  # frozen, as under a LoRA
    before = {n: (m.weight.clone(), m.weight_scale.clone()) for n, m in den.named_modules()
              if isinstance(m, ScaledFp8Linear)}
    precision.enable_fp8_base_weights(den)
    modules = dict(den.named_modules())
    for name, (codes, scale) in before.items():
        assert torch.equal(modules[name].weight, codes) and torch.equal(modules[name].weight_scale, scale), name
    ours = [n for n in precision.quantised_layers(den, "fp8") if n not in before]
    assert ours and all(modules[n].weight_scale.dtype == torch.uint16 for n in ours)  # quantised here, bf16 scales


def test_other_base_weights_are_refused_naming_the_file_and_a_tensor(case):
    den = case["comfy"].load_denoiser()
    for kind in ("auto", "int8"):
        with pytest.raises(ValueError, match=r"fp8_scaled\.safetensors \(e\.g\. .+\.weight\) holds scaled fp8 "
                           rf"weights; train\.base_weights is {kind}.*set train\.base_weights: fp8"):
            precision.prepare_denoiser(den, TrainConfig(base_weights=kind))


def test_the_fingerprint_follows_the_files_content(case):
    comfy = denoiser_fingerprint(case["comfy"])
    assert comfy != denoiser_fingerprint(case["held"])
    tensors = load_file(str(case["root"] / "fp8_scaled.safetensors"))
    key = next(k for k in sorted(tensors) if k.endswith(".scale_weight"))
    tensors[key] = tensors[key] * 2
    save_file(tensors, str(case["root"] / "changed.safetensors"))
    assert denoiser_fingerprint(case["local"]("changed.safetensors")) not in (comfy, denoiser_fingerprint(case["held"]))


def test_a_bad_scale_is_an_error_naming_the_file_and_tensor(case, tmp_path):
    tensors = load_file(str(case["root"] / "fp8_scaled.safetensors"))
    key = next(k for k in sorted(tensors) if k.endswith(".scale_weight"))
    tensors[key] = torch.ones(3, 5)
    save_file(tensors, str(case["root"] / "bad.safetensors"))
    with pytest.raises(ValueError, match=rf"model\.single_files\.transformer: .*bad\.safetensors: {key} has shape"):
        case["local"]("bad.safetensors").load_denoiser()
    tensors = load_file(str(case["root"] / "fp8_scaled.safetensors"))
    weight = key.replace(".scale_weight", ".weight")
    tensors[weight] = tensors[weight].float().to(torch.float8_e5m2)
    save_file(tensors, str(case["root"] / "e5m2.safetensors"))
    with pytest.raises(ValueError, match=rf"e5m2\.safetensors: tensor {weight} is float8_e5m2"):
        case["local"]("e5m2.safetensors").load_denoiser()


@pytest.mark.slow  # a DeepSpeed training run (25 s): `make test`, not the edit loop's `make test-fast`
@pytest.mark.parametrize("case", ["zimage"], indirect=True)  # one family trains: the load is what differs
def test_a_short_lora_run_trains_on_the_file(case, tmp_path):
    """Cache with the local model (its VAE and text encoder from the folder), then two steps of LoRA training
    with base_weights fp8 in this process: the loss is finite and the adapter is written."""
    from diffpipe import stages
    from diffpipe.data.dataset.demo import write_demo_dataset
    from diffpipe.paths import RunPaths
    from diffpipe.training.loop import train

    write_demo_dataset(tmp_path / "data", n=2, size=32)
    raw = {"output_dir": str(tmp_path / "run"),
           "model": {**case["comfy"].cfg.model_dump(mode="json", exclude_unset=True)},
           "datasets": [{"name": "d", "path": str(tmp_path / "data"), "resolution": 32}], "cache": {"shards": 1},
           "train": {"max_steps": 2, "batch_size": 1, "base_weights": "fp8", "lora": {"rank": 4, "alpha": 4},
                     "eval": {"quantiles": []}, "save_every_epochs": 0}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    cfg = parse_config(raw)
    paths = RunPaths(cfg.output_dir)
    stages.prepare_data(cfg, paths)
    lines: list[str] = []
    patch = rendezvous()
    try:
        result = train(cfg, paths, log=lines.append)
    finally:
        patch.undo()
    assert torch.isfinite(torch.tensor(result.last_loss)), lines[-5:]
    assert any("base_weights fp8" in line for line in lines)
    assert (paths.adapter_dir).exists()
