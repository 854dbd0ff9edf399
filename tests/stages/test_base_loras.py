"""Base LoRAs (``model.base_loras``): folded into the frozen denoiser and text encoder for caching, training and
samples; left out of the export, or joined into it (``export.include_base_loras``).

One tiny training run over a diffusers-format base LoRA with a text-encoder part: its text cache equals the
stock pipeline's prompt encoding with the base LoRA file loaded (``load_lora_weights``); its exported LoRA,
loaded beside the base LoRA file into the stock pipeline (two adapters), reproduces training's denoiser output;
exported with ``include_base_loras``, a file loaded alone does. The base LoRA's formats (diffusers, kohya,
ComfyUI, a LoKr) are checked at the fold: the folded weights equal the base plus PEFT's own delta of the same
adapter, at the configured scale; the text encoder's fold equals the stock loader's.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from stage_cli import in_process

from diffpipe import stages
from diffpipe.config import ConfigError, LoraConfig, ModelConfig, SampleConfig, TrainConfig, parse_config
from diffpipe.data.cache.plan import read_spec
from diffpipe.data.cache.text import TextShard
from diffpipe.export import export_lora
from diffpipe.export.base_loras import prepare_base_loras, text_base_loras, with_base_loras
from diffpipe.families import get_family
from diffpipe.paths import RunPaths
from diffpipe.stages import stage_digest
from diffpipe.training import load
from diffpipe.training.adapter import add_lora, apply_adapter, lora_state_dict, peft_config, save_adapter
from diffpipe.training.base_loras import BaseDeltas, holds_bases
from diffpipe.training.sample import TrainingSampler, sample_pipeline
from diffpipe.training.text_encoders import TrainedTextEncoders

SCALE = 0.7


def _randomise(module: torch.nn.Module, seed: int, scale: float = 0.05) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        if "lora_" in name or "lokr_" in name:
            p.data = torch.randn(p.shape, generator=g) * scale


def _text_adapter(seed: int):
    """A random nonzero LoRA (rank 2, alpha 3) on the tiny CLIP text encoder: ``(state dict, PEFT config)``."""
    encoder = get_family(ModelConfig(family="sd", flavor="tiny")).load_text_encoders().text_encoder
    targets = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
    cfg = peft_config(LoraConfig(rank=2, alpha=3.0, targets=targets), targets)
    add_lora(encoder, cfg)
    _randomise(encoder, seed, 0.2)
    return lora_state_dict(encoder), cfg


def _base_adapter(folder, kind: str, seed: int, *, text: bool = False):
    """A random nonzero adapter on the tiny UNet (and its text encoder: ``text``), saved as training saves one;
    returns the family."""
    family = get_family(ModelConfig(family="sd", flavor="tiny"))
    targets = family.lora_targets(None)
    options = {"lokr_factor": 2} if kind == "lokr" else {}
    cfg = peft_config(LoraConfig(kind=kind, rank=4, alpha=6.0, targets=targets, **options), targets)
    unet = family.load_denoiser()
    add_lora(unet, cfg)
    _randomise(unet, seed)
    save_adapter(folder, lora_state_dict(unet), cfg, {"family": "sd", "flavor": "tiny"},
                 text_encoders={"text_encoder": _text_adapter(seed + 10)} if text else None)
    return family


@pytest.fixture(scope="module")
def base_files(tmp_path_factory):
    """The same LoRA as diffusers, kohya and ComfyUI files, a LoKr as a ComfyUI file, and a LoRA with a text
    encoder's part as diffusers and kohya files; by case name."""
    root = tmp_path_factory.mktemp("base-loras")
    family = _base_adapter(root / "lora", "lora", 1)
    lora = export_lora(root / "lora", root / "lora-export", family, ["diffusers", "kohya", "comfyui"]).files
    _base_adapter(root / "lokr", "lokr", 2)
    lokr = export_lora(root / "lokr", root / "lokr-export", family, ["comfyui"]).files
    _base_adapter(root / "lora-te", "lora", 3, text=True)
    te = export_lora(root / "lora-te", root / "lora-te-export", family, ["diffusers", "kohya"]).files
    return {"diffusers": (lora["diffusers"], root / "lora"), "kohya": (lora["kohya"], root / "lora"),
            "comfyui": (lora["comfyui"], root / "lora"), "lokr-comfyui": (lokr["comfyui"], root / "lokr"),
            "diffusers-te": (te["diffusers"], root / "lora-te"), "kohya-te": (te["kohya"], root / "lora-te")}


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


CAPTIONS = ["a red circle on blue", "two green squares", ""]


def _sd(*bases) -> ModelConfig:
    return ModelConfig(family="sd", flavor="tiny", base_loras=[{"path": str(f), "scale": s} for f, s in bases])


def _encode(pipe, captions: list[str] = CAPTIONS) -> torch.Tensor:
    with torch.no_grad():
        return pipe.encode_prompt(captions, device=torch.device("cpu"), num_images_per_prompt=1,
                                  do_classifier_free_guidance=False)[0]


def _stock_prompt(file=None, captions: list[str] = CAPTIONS) -> torch.Tensor:
    """The stock pipeline's prompt embeddings, with ``file`` loaded at 0.7 by diffusers' own loader."""
    pipe = get_family(_sd()).load_pipeline()
    if file is not None:
        pipe.load_lora_weights(str(file), adapter_name="base")
        pipe.set_adapters(["base"], adapter_weights=[SCALE])
    return _encode(pipe, captions)


@pytest.mark.parametrize("case", ["diffusers-te", "kohya-te"])
def test_text_fold_equals_stock_loader(base_files, case, tmp_path):
    """A base LoRA's text-encoder part is folded into the encoder wherever it loads: the caches' encoding, a
    trained encoder (its fresh LoRA a no-op) and the in-training sampler's pipeline all give what the stock
    pipeline gives with the same file loaded by ``load_lora_weights`` at the same scale."""
    file = base_files[case][0]
    family = text_base_loras(get_family(_sd((file, SCALE))), tmp_path)
    assert set(family.base_text) == {"text_encoder"}
    want, plain = _stock_prompt(file), _stock_prompt()
    cached = family.encode_text(family.load_text_encoders(), CAPTIONS)["prompt_embeds"]
    tc = TrainConfig(text_encoder={"encoders": ["text_encoder"]})
    family.with_trained_text(["text_encoder"])
    trained = TrainedTextEncoders(family, tc).modules
    with torch.no_grad():
        step = family.embed_ids(trained, family.encode_text(family.load_text_encoders(), CAPTIONS))["prompt_embeds"]
    sampler = TrainingSampler(family, SampleConfig(prompts=["a"]), family.load_denoiser(), tmp_path / "samples")
    sampled = _encode(sampler._pipeline())
    for got in (cached, step, sampled):
        err = (got - want).abs().max().item()
        assert err <= 1e-5, err
    print(f"{case}: text fold vs stock load_lora_weights: max abs {(cached - want).abs().max().item():.3g}; "
          f"without the base LoRA: {(plain - want).abs().max().item():.3g}")
    assert (plain - want).abs().max() > 1e-2


def test_text_cache_key_follows_text_parts_only(base_files, tmp_path):
    """The text cache key changes with a base LoRA's text part (its content and scale), not with a
    denoiser-only base LoRA; so do the plan and cache stages' digests."""
    plain = get_family(_sd()).text_identity()
    unet_only = base_files["diffusers"][0]
    te_file = tmp_path / "te.safetensors"
    te_file.write_bytes(base_files["diffusers-te"][0].read_bytes())

    def identity(*bases):
        return text_base_loras(get_family(_sd(*bases)), tmp_path / "run").text_identity()

    def digests(*bases):
        cfg = parse_config({"output_dir": str(tmp_path / "run"), "datasets": [{"name": "d", "path": str(tmp_path / "data")}],
                            "model": {"family": "sd", "flavor": "tiny",
                                      "base_loras": [{"path": str(f), "scale": s} for f, s in bases]}})
        return {stage: stage_digest(cfg, stage) for stage in ("plan", "cache", "train")}

    assert identity((unet_only, SCALE)) == plain
    none, unet = digests(), digests((unet_only, SCALE))
    assert unet["plan"] == none["plan"] and unet["cache"] == none["cache"] and unet["train"] != none["train"]
    first, first_digests = identity((te_file, SCALE)), digests((te_file, SCALE))
    assert first != plain and first == identity((unet_only, 0.5), (te_file, SCALE))
    assert identity((te_file, 0.5)) != first
    assert digests((te_file, 0.5))["cache"] != first_digests["cache"] != none["cache"]
    te_file.write_bytes(base_files["kohya-te"][0].read_bytes())  # same path, same update, other bytes
    assert identity((te_file, SCALE)) != first
    assert digests((te_file, SCALE))["plan"] != first_digests["plan"]


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


def _unet_outputs(pipe, loaded: list[tuple[str, str, float]]) -> torch.Tensor:
    """The stock pipeline's UNet output with these files loaded (``(file, adapter name, weight)``)."""
    for file, name, _ in loaded:
        pipe.load_lora_weights(file, adapter_name=name)
    if loaded:
        pipe.set_adapters([n for _, n, _ in loaded], adapter_weights=[w for _, _, w in loaded])
    x, t, text = _inputs()
    with torch.no_grad():
        return pipe.unet(x, t, encoder_hidden_states=text).sample


@pytest.fixture(scope="module")
def trained_over_base(tiny_run, base_files, tmp_path_factory):
    """A tiny run planned, cached and trained over the diffusers base LoRA with a text-encoder part at 0.7."""
    root = tmp_path_factory.mktemp("over-base")
    base_file = base_files["diffusers-te"][0]
    cfg_file = tiny_run.clone(root, epochs=1)
    cfg = yaml.safe_load(cfg_file.read_text())
    cfg["model"] = {"base_loras": [{"path": str(base_file), "scale": SCALE}]}
    cfg_file.write_text(yaml.safe_dump(cfg))
    parsed, paths = parse_config(cfg), RunPaths(root / "run")
    stages.prepare_data(parsed, paths)  # the base LoRA's text part changes the text keys: replanned, recached
    result = in_process("train", "-c", str(cfg_file))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "base LoRA(s) folded into the frozen denoiser; text encoder(s) text_encoder too" in (
        result.stdout + result.stderr)
    family = get_family(parsed.model)
    folders = prepare_base_loras(family.cfg, family, paths.root)
    trained = load.load_denoiser(family, parsed.train, torch.device("cpu"), base=BaseDeltas.read(folders)).module
    apply_adapter(trained, paths.adapter_dir)
    x, t, text = _inputs()
    with torch.no_grad():
        want = trained(x, t, encoder_hidden_states=text).sample
    return parsed, paths, base_file, want, root


def test_text_cache_jobs_fold_the_base_lora(trained_over_base):
    """The text cache jobs encoded every caption (the empty one too) with the base LoRA's text part folded in,
    as the stock pipeline encodes them with the file loaded."""
    _, paths, base_file, _, _ = trained_over_base
    shard = paths.shard_names("text")[0]
    captions = [item["caption"] for item in read_spec(paths.text_spec(shard))["items"]]
    cached = torch.tensor(TextShard(paths.text_shard(shard)).read("prompt_embeds"))
    empty = torch.tensor(TextShard(paths.text_empty).read("prompt_embeds"))
    want, plain = _stock_prompt(base_file, captions + [""]), _stock_prompt(captions=captions + [""])
    got = torch.cat([cached, empty])
    assert (got - want).abs().max() <= 1e-5 < (got - plain).abs().max()


def test_trained_over_base_lora_reproduces_in_stock_pipeline(trained_over_base, tmp_path):
    """Train over a base LoRA, export without it; the stock pipeline with both files loaded gives training's
    denoiser output. Without the base LoRA it does not (the trained LoRA alone is not the trained model)."""
    parsed, paths, base_file, want, _ = trained_over_base
    family = get_family(parsed.model)
    exported = export_lora(paths.adapter_dir, tmp_path / "export", family, ["diffusers"], config=parsed)
    card = exported.card.read_text()
    assert "## Base LoRAs" in card and str(base_file) in card and "not in the files above" in card
    trained_file = str(exported.files["diffusers"])
    got = _unet_outputs(family.load_pipeline(), [(str(base_file), "base", SCALE), (trained_file, "trained", 1.0)])
    alone = _unet_outputs(family.load_pipeline(), [(trained_file, "trained", 1.0)])
    err = (got - want).abs().max().item()
    rel = err / want.abs().max().item()
    print(f"exported-over-base-LoRA reproduction: max abs {err:.3g}, relative {rel:.3g}; "
          f"without the base LoRA: max abs {(alone - want).abs().max().item():.3g}")
    assert rel <= 1e-5, (err, rel)
    assert (alone - want).abs().max() > 100 * err + 1e-4


def test_export_includes_base_loras(trained_over_base, tmp_path):
    """``export.include_base_loras``: the diffusers and kohya files, each loaded alone by diffusers' loader,
    reproduce training's denoiser (base LoRA folded + trained LoRA) and its text encoder (base LoRA's part);
    the merged folder holds both; the card says so; ``diffpipe sample`` folds nothing more over such a file
    (and does over the trained LoRA alone)."""
    parsed, paths, base_file, want, _ = trained_over_base
    family = get_family(parsed.model)
    folders = prepare_base_loras(family.cfg, family, paths.root)
    config = parsed.model_copy(update={"export": parsed.export.model_copy(update={"include_base_loras": True})})
    formats = ["diffusers", "kohya", "merged"]
    exported = export_lora(paths.adapter_dir, tmp_path / "export", family, formats, config=config, run=paths)
    card = exported.card.read_text()
    assert "included in the files above" in card and str(base_file) in card
    text_want = _stock_prompt(base_file)
    errors = {}
    for fmt in ("diffusers", "kohya"):
        pipe = family.load_pipeline()
        got = _unet_outputs(pipe, [(str(exported.files[fmt]), "all", 1.0)])
        text = _encode(pipe)
        errors[fmt] = ((got - want).abs().max().item() / want.abs().max().item(),
                       (text - text_want).abs().max().item())
        assert holds_bases(exported.files[fmt])
    # diffpipe sample over such a file folds no base LoRA: the pipeline it loads the file into is the plain one.
    _, over_file = sample_pipeline(parsed.model, exported.files["diffusers"], folders)
    _, over_trained = sample_pipeline(parsed.model, paths.adapter_dir, folders)
    plain = get_family(parsed.model).load_pipeline()
    assert torch.equal(_unet_outputs(over_file, []), _unet_outputs(plain, []))
    assert torch.equal(_encode(over_file), _encode(plain)) and not torch.equal(_encode(over_trained), _encode(plain))
    merged = type(family.load_pipeline()).from_pretrained(exported.files["merged"])
    x, t, text = _inputs()
    with torch.no_grad():
        merged_err = (merged.unet(x, t, encoder_hidden_states=text).sample - want).abs().max().item()
    merged_text = _encode(merged)
    print(f"include_base_loras, file alone vs training (relative UNet, abs text): {errors}; merged folder: "
          f"UNet {merged_err:.3g}, text {(merged_text - text_want).abs().max().item():.3g}")
    for unet_rel, text_abs in errors.values():
        assert unet_rel <= 1e-5 and text_abs <= 1e-5
    assert merged_err <= 1e-5 * want.abs().max() and (merged_text - text_want).abs().max() <= 1e-5
    assert not holds_bases(paths.adapter_dir)


def test_include_base_loras_refuses_what_cannot_be_exact(base_files, tmp_path):
    """A LoKr (trained or base) cannot be joined with a LoRA into one file: refused naming the formats and why, as a
    config error (the CLI's exit 2), before anything is written."""
    lokr, lora = base_files["lokr-comfyui"][1], base_files["diffusers"][1]
    with pytest.raises(ConfigError, match=r"formats diffusers, kohya: the trained LoRA .* is a lokr: .*Kronecker"):
        with_base_loras(lokr, [(lora, 1.0)], tmp_path / "a", ["diffusers", "kohya"])
    with pytest.raises(ConfigError, match=r"formats peft: the base LoRA .* is a lokr"):
        with_base_loras(lora, [(lokr, 1.0)], tmp_path / "b", ["peft"])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


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
