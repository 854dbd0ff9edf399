"""``train.text_encoder``: LoRA on the text encoders beside the denoiser's (SD 1.x/2.x, SDXL, Flux's CLIP-L).

The encoding split is checked against the stock pipeline's ``encode_prompt`` (cached token ids of the
trained encoders, cached states of the others, assembled at the step). Then a tiny SD run, a tiny
SDXL run (both encoders) and a tiny Flux run (CLIP-L) go through every stage in-process (validate, plan, cache, DeepSpeed
training with caption dropout and eval, export in every format, samples): the stock pipeline's
``load_lora_weights`` reads the diffusers file and the kohya file (diffusers' own kohya converter: an
independent reader) and its ``encode_prompt`` then equals the trained encoders'; the ComfyUI file's
text-encoder names are ComfyUI's; the merged folder and ``import-lora`` reproduce them; resume is exact.
"""

from __future__ import annotations

import shutil

import comfy_rules
import pytest
import torch
import yaml
from diffusers import FluxPipeline
from safetensors.torch import load_file
from stage_cli import in_process, invoke, rendezvous, run_stages

from diffpipe.config import ModelConfig, load_config, parse_config
from diffpipe.data.cache.text import TextShard
from diffpipe.families import get_family
from diffpipe.models.base import ids_name
from diffpipe.paths import REPO_ROOT, RunPaths
from diffpipe.training.adapter import apply_state, load_adapter
from diffpipe.training.text_encoders import load_text_adapters

pytestmark = pytest.mark.slow

CAPTIONS = ["a red circle on blue", "two green squares", ""]
RUNS = {"sd": ["text_encoder"], "sdxl": ["text_encoder", "text_encoder_2"], "flux": ["text_encoder"]}
#: What stays cached as embeddings in those runs (Flux: T5's).
CACHED = {"sd": set(), "sdxl": set(), "flux": {"prompt_embeds"}}


def _stock_prompt(pipe, captions: list[str]) -> dict[str, torch.Tensor]:
    if isinstance(pipe, FluxPipeline):  # (prompt_embeds, pooled_prompt_embeds, text_ids)
        out = pipe.encode_prompt(captions, prompt_2=None, device=torch.device("cpu"),
                                 max_sequence_length=pipe.tokenizer_2.model_max_length)
        return {"prompt_embeds": out[0], "pooled_prompt_embeds": out[1]}
    out = pipe.encode_prompt(captions, device=torch.device("cpu"), num_images_per_prompt=1,
                             do_classifier_free_guidance=False)
    return {"prompt_embeds": out[0]} if len(out) == 2 else {"prompt_embeds": out[0], "pooled_prompt_embeds": out[2]}


@pytest.mark.parametrize("family_name, trained, states", [
    ("sd", ["text_encoder"], set()),
    ("sdxl", ["text_encoder"], {"prompt_embeds_2", "pooled_prompt_embeds"}),  # CLIP-G's states stay cached
    ("sdxl", ["text_encoder_2"], {"prompt_embeds_1"}),
    ("sdxl", RUNS["sdxl"], set()),
    ("flux", ["text_encoder"], {"prompt_embeds"}),  # CLIP-L's pooled output trains, T5's states stay cached
])
def test_cached_ids_and_states_assemble_to_the_stock_encoding(family_name, trained, states):
    family = get_family(ModelConfig(family=family_name, flavor="tiny"))
    pipe = family.load_pipeline()
    family.with_trained_text(trained)
    bundle = family.load_text_encoders()
    cached = family.encode_text(bundle, CAPTIONS)
    assert {k for k, v in cached.items() if not v.is_floating_point()} == {ids_name(n) for n in trained}
    assert {k for k, v in cached.items() if v.is_floating_point()} == states
    with torch.no_grad():
        got = family.embed_ids({n: getattr(bundle, n) for n in trained}, cached)
    want = _stock_prompt(pipe, CAPTIONS)
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5)


def test_config_and_family_refuse_what_they_cannot_train():
    base = {"datasets": [{"name": "d", "path": "data"}]}
    for bad in ({"mode": "full"}, {"zero_stage": 3}, {"pipeline_stages": 2}, {"lora": {"kind": "lokr"}}):
        with pytest.raises(ValueError, match="train.text_encoder needs"):
            parse_config({**base, "train": {"text_encoder": {"encoders": ["text_encoder"]}, **bad}})
    with pytest.raises(ValueError, match="prior_target base needs train.text_encoder.encoders empty"):
        parse_config({"datasets": [{"name": "d", "path": "data", "role": "regularization", "prior_target": "base"}],
                      "train": {"text_encoder": {"encoders": ["text_encoder"]}}})
    cfg = parse_config({**base, "model": {"family": "chroma", "flavor": "tiny"}})
    with pytest.raises(ValueError, match="family .chroma. trains text encoders: none"):
        get_family(cfg.model).with_trained_text(["text_encoder"])
    with pytest.raises(ValueError, match="text_encoder_2.*trains text encoders: text_encoder$"):
        get_family(parse_config(base).model).with_trained_text(["text_encoder_2"])


def _config(name: str, root, data) -> dict:
    return {
        "output_dir": "run",
        "model": {"family": name, "flavor": "tiny"},
        "datasets": [{"name": "shapes", "path": str(data), "resolution": 64}],
        "cache": {"shards": 1, "workers": 0},
        "train": {"max_steps": 3, "batch_size": 2, "lr": 0.01, "save_every_epochs": 0, "caption_dropout": 0.3,
                  "checkpoint_every_steps": 1, "eval": {"quantiles": [0.5]}, "lora": {"rank": 4, "alpha": 4},
                  "text_encoder": {"encoders": RUNS[name], "lr": 0.05, "rank": 2, "alpha": 4}},
        "export": {"formats": ["diffusers", "peft", "kohya", "comfyui", "merged"]},
        "sample": {"prompts": ["a red circle"], "steps": 2},
    }


@pytest.fixture(scope="module", params=sorted(RUNS))
def run(request, tmp_path_factory):
    name = request.param
    root = tmp_path_factory.mktemp(f"te-{name}")
    shutil.copytree(REPO_ROOT / "config" / "demo_data", root / "data")
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump(_config(name, root, root / "data")))
    monkeypatch = rendezvous()
    try:
        run_stages(config, cwd=root, monkeypatch=monkeypatch, empty_caption=True)
    finally:
        monkeypatch.undo()
    return load_config(config), RunPaths(root / "run"), root


def test_golden_losses_and_lora(run, golden):
    """The losses (the encoders run at every step) and the denoiser's LoRA equal the stored values."""
    cfg, paths, _ = run
    golden(cfg.model.family, "test_text_encoder_training::run", paths)


def _trained_prompt(cfg, paths, captions) -> dict[str, torch.Tensor]:
    """What the trained encoders give: fresh encoders with the run's adapters, through the family."""
    family = get_family(cfg.model).with_trained_text(cfg.train.text_encoder.encoders)
    bundle = family.load_text_encoders()
    adapters = load_text_adapters(paths.adapter_dir)
    assert sorted(adapters) == sorted(cfg.train.text_encoder.encoders)
    for name, (sd, lcfg) in adapters.items():
        apply_state(getattr(bundle, name), sd, lcfg, source=name).eval()
    with torch.no_grad():
        return family.embed_ids({n: getattr(bundle, n) for n in adapters}, family.encode_text(bundle, captions))


def test_cache_holds_token_ids_and_training_moves_the_encoders(run):
    cfg, paths, _ = run
    names = cfg.train.text_encoder.encoders
    shard = TextShard(paths.text_shard(paths.shard_names("text")[0]))
    assert set(shard.names) == {ids_name(n) for n in names} | CACHED[cfg.model.family]
    assert {k for k, t in shard.tensors().items() if t.is_floating_point()} == CACHED[cfg.model.family]
    assert sorted(TextShard(paths.text_empty).names) == sorted(shard.names)
    layers = max(int(k.split("layers.")[1].split(".")[0]) for k in load_adapter(paths.adapter_dir / names[0])[0]) + 1
    for name, (sd, lcfg) in load_text_adapters(paths.adapter_dir).items():
        assert lcfg.r == 2 and lcfg.lora_alpha == 4, name
        ups = [k for k in sd if "lora_B" in k]
        still = [k for k in ups if sd[k].abs().max() == 0]
        assert len(still) < len(ups), f"{name} was not trained"
        # Only where no gradient reaches: SDXL reads CLIP-L's penultimate hidden states, not its last layer.
        assert all(f"layers.{layers - 1}." in k for k in still) and (not still or name == "text_encoder"), still
    rows = [line for line in paths.metrics.read_text().splitlines() if line]
    assert len(rows) == 3 and all("eval_loss" in r for r in rows[-1:])
    assert paths.sample_grid.is_file()


def _assert_prompt(got: dict, want: dict, base: dict) -> None:
    assert any((want[k] - base[k]).abs().max() > 1e-4 for k in want), "training left the encoding unchanged"
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5)


def test_stock_load_lora_weights_reproduces_the_trained_encoders(run):
    _check_stock_load(run, "diffusers")


# diffusers' Flux kohya converter splits the fused layers at FLUX.1's real widths only (an assertion at tiny
# size); Flux's kohya text-encoder names are ComfyUI's, checked below.
@pytest.mark.parametrize("run", ["sd", "sdxl"], indirect=True)
def test_stock_load_lora_weights_reads_the_kohya_file(run):
    _check_stock_load(run, "kohya")


def _check_stock_load(run, fmt: str) -> None:
    cfg, paths, _ = run
    family = get_family(cfg.model)
    pipe = family.load_pipeline()
    base = _stock_prompt(pipe, CAPTIONS)
    pipe.load_lora_weights(str(paths.export_file(fmt)))
    _assert_prompt(_stock_prompt(pipe, CAPTIONS), _trained_prompt(cfg, paths, CAPTIONS), base)
    # The denoiser's LoRA came with it.
    assert any("lora" in n for n, _ in getattr(pipe, family.denoiser_name).named_modules())


def test_comfyui_file_names_the_encoders_as_comfyui_reads_them(run):
    cfg, paths, _ = run
    family = get_family(cfg.model)
    bundle = family.load_text_encoders()
    layers = {n: getattr(bundle, n).config.num_hidden_layers for n in cfg.train.text_encoder.encoders}
    known = comfy_rules.clip_lora_keys(layers, sdxl=cfg.model.family == "sdxl")
    tensors = load_file(str(paths.export_file("comfyui")))
    kohya = load_file(str(paths.export_file("kohya")))
    text_keys = sorted(k for k in tensors if k.startswith("lora_te"))
    assert text_keys == sorted(k for k in kohya if k.startswith("lora_te"))  # the same names in both files
    assert all(torch.equal(tensors[k], kohya[k]) for k in text_keys)
    text_layers = {k.split(".")[0] for k in tensors if k.startswith("lora_te")}  # kohya names hold no dots
    assert text_layers and text_layers <= set(known), sorted(text_layers - set(known))[:3]
    assert {known[k][0] for k in text_layers} == set(cfg.train.text_encoder.encoders)
    trained = {n: sd for n, (sd, _) in load_text_adapters(paths.adapter_dir).items()}
    for layer in text_layers:  # each at the trained strength: alpha / rank and the trained matrices
        encoder, module = known[layer]
        if f"{module}.lora_A.weight" not in trained[encoder]:  # transformers 5 holds CLIP's layers at the top
            module = module.removeprefix("text_model.")
        torch.testing.assert_close(tensors[f"{layer}.lora_down.weight"], trained[encoder][f"{module}.lora_A.weight"])
        assert float(tensors[f"{layer}.alpha"]) == 4.0


def test_diffusers_file_names_the_encoders_as_comfyui_reads_them(run):
    """ComfyUI maps a diffusers file's CLIP LoRA only under ``text_model.`` (transformers 4's paths); written with
    transformers 5's paths, every text-encoder tensor was dropped with a log warning. diffusers' own loader
    strips the prefix where the installed transformers has none (the stock-load test above)."""
    cfg, paths, _ = run
    bundle = get_family(cfg.model).load_text_encoders()
    layers = {n: getattr(bundle, n).config.num_hidden_layers for n in cfg.train.text_encoder.encoders}
    known = comfy_rules.clip_diffusers_lora_keys(layers)
    tensors = load_file(str(paths.export_file("diffusers")))
    text = {k.rsplit(".lora_", 1)[0] for k in tensors if k.startswith(tuple(f"{n}." for n in layers))}
    assert text and text <= set(known), sorted(text - set(known))[:3]
    assert {known[m][0] for m in text} == set(layers)


def test_merged_folder_and_import_reproduce_the_encoders(run, tmp_path):
    cfg, paths, root = run
    family = get_family(cfg.model)
    want = _trained_prompt(cfg, paths, CAPTIONS)
    merged = family.pipeline_class.from_pretrained(str(paths.export_file("merged")))
    for k, v in _stock_prompt(merged, CAPTIONS).items():
        torch.testing.assert_close(v, want[k], rtol=1e-4, atol=1e-4)
    trained = load_text_adapters(paths.adapter_dir)
    for fmt in ("diffusers", "kohya", "comfyui", "peft"):
        out = tmp_path / fmt
        invoke("import-lora", str(paths.export_file(fmt)), str(out), "-c", str(root / "config.yaml"),
               cwd=root, monkeypatch=pytest.MonkeyPatch())
        imported = load_text_adapters(out)
        assert sorted(imported) == sorted(trained), fmt
        for name, (sd, lcfg) in trained.items():
            scale = lcfg.lora_alpha / lcfg.r
            got_sd, got_cfg = imported[name]
            for key in (k for k in sd if k.endswith("lora_A.weight")):
                module = key.removesuffix(".lora_A.weight")
                delta = scale * sd[f"{module}.lora_B.weight"] @ sd[key]
                got_scale = got_cfg.alpha_pattern.get(module, got_cfg.lora_alpha) / got_sd[key].shape[0]
                got = got_scale * got_sd[f"{module}.lora_B.weight"] @ got_sd[key]
                torch.testing.assert_close(got, delta, rtol=1e-5, atol=1e-6, msg=f"{fmt} {name} {module}")


@pytest.mark.parametrize("run", ["sdxl"], indirect=True)  # one family: a process and a run more each
def test_resume_is_exact(run, cli, tmp_path):
    cfg, paths, root = run
    shutil.copytree(root / "data", tmp_path / "data")
    shutil.copytree(paths.root, tmp_path / "run", ignore=shutil.ignore_patterns("train", "export", "samples"))
    raw = _config(cfg.model.family, tmp_path, tmp_path / "data")
    raw["output_dir"] = str(tmp_path / "run")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    killed = cli("train", "-c", str(config), env={"DIFFPIPE_FAULT": "after-step:2"})
    assert killed.returncode == 17, killed.stderr[-3000:]
    resumed = in_process("train", "-c", str(config), "--resume")  # the killed run had to be a process
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, have = load_text_adapters(paths.adapter_dir), load_text_adapters(RunPaths(tmp_path / "run").adapter_dir)
    for name in want:
        for k, v in want[name][0].items():
            torch.testing.assert_close(have[name][0][k], v, rtol=0, atol=1e-7)
    torch.testing.assert_close(load_adapter(RunPaths(tmp_path / "run").adapter_dir)[0],
                               load_adapter(paths.adapter_dir)[0], rtol=0, atol=1e-7)


def test_kohya_metadata_and_card_say_the_encoders_were_trained(run):
    from safetensors import safe_open

    cfg, paths, _ = run
    with safe_open(str(paths.export_file("kohya")), framework="pt") as f:
        header = f.metadata()
    assert header["ss_network_train_unet_only"] == "False" and header["ss_text_encoder_lr"] == "0.05"
    card = (paths.export_dir / "README.md").read_text()
    assert "text encoders trained too" in card and all(f"`{n}`" in card for n in cfg.train.text_encoder.encoders)


def test_init_from_continues_the_encoders_lora(run):
    from diffpipe.training.text_encoders import TrainedTextEncoders

    cfg, paths, _ = run
    tc = cfg.train.model_copy(update={"lora": cfg.train.lora.model_copy(update={"init_from": str(paths.adapter_dir)})})
    got = TrainedTextEncoders(get_family(cfg.model), tc).state()
    for name, (want, _) in load_text_adapters(paths.adapter_dir).items():
        assert set(got[name]) == set(want)
        for k, v in want.items():
            torch.testing.assert_close(got[name][k], v, rtol=0, atol=0)
