"""Qwen-Image-Edit-Plus (``qwenimage-edit``, ``model.variant: 2511``): several reference images per item.

Each item has two references, from two folders (``control_path`` as a list);
a fifth item lacks its second reference and is dropped as ``missing_control``.
validate → plan → cache (targets, the references' latents as control frames,
text encoded with both references) → 2 DeepSpeed steps → diffusers export,
in-process through the Typer app. Then, against the stock
``QwenImageEditPlusPipeline``: the cached text equals its ``encode_prompt`` on
the caption and both (resized) references, the reference tokens and
``img_shapes`` equal what its ``prepare_latents`` and ``__call__`` build, each
reference conditions the loss, and the exported LoRA loads into the pipeline
and reproduces the trained adapter (2511's transformer zeroes the references'
timestep: ``zero_cond_t``). The losses and the LoRA are golden
(``tests/assets/golden_losses.json``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from diffusers import QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE, calculate_dimensions
from PIL import Image
from stage_cli import edit_outputs as _outputs
from stage_cli import rendezvous, run_stages

from diffpipe.config import ModelConfig, load_config, parse_config
from diffpipe.data.cache.plan import read_spec
from diffpipe.data.cache.reader import CachedDataset
from diffpipe.data.cache.text import TextShard
from diffpipe.families import get_family
from diffpipe.paths import RunPaths
from diffpipe.training.adapter import apply_adapter

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwenplus")
    rng = np.random.default_rng(0)
    for folder in ("data", "ref1", "ref2"):
        (root / folder).mkdir()
    for i in range(5):  # reference 1: the target inverted; reference 2: its channels swapped
        img = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
        Image.fromarray(img).save(root / "data" / f"item_{i}.png")
        (root / "data" / f"item_{i}.txt").write_text("put them together" if i % 2 else "swap the colours")
        Image.fromarray(255 - img).save(root / "ref1" / f"item_{i}.png")
        if i < 4:  # item_4 has no second reference
            Image.fromarray(img[..., ::-1].copy()).save(root / "ref2" / f"item_{i}.png")
    cfg = {
        "output_dir": "run",
        "model": {"family": "qwenimage-edit", "flavor": "tiny", "variant": "2511"},
        "datasets": [{"name": "edits", "path": str(root / "data"),
                      "control_path": [str(root / "ref1"), str(root / "ref2")], "resolution": 32}],
        "cache": {"shards": 1, "workers": 0},
        "train": {"max_steps": 2, "batch_size": 2, "lr": 0.01, "save_every_epochs": 0, "eval": {"quantiles": []}},
        "export": {"formats": ["diffusers"]},
    }
    config = root / "qwenplus.yaml"
    config.write_text(yaml.safe_dump(cfg))
    monkeypatch = rendezvous()
    try:
        # No sample stage: the pipeline encodes each reference at about 1024x1024 whatever the output size.
        run_stages(str(config), cwd=root, monkeypatch=monkeypatch, then=("train", "export"))
    finally:
        monkeypatch.undo()
    return load_config(config), RunPaths(root / "run"), root


def test_golden_losses_and_lora(run, golden):
    """The 2 losses and the exported LoRA equal the stored golden values (tests/golden.py)."""
    _, p, _ = run
    golden("qwenimage-edit", "test_qwenimage_edit_plus::run", p)


def test_an_item_missing_a_reference_is_dropped_by_name(run):
    _, p, root = run
    report = json.loads(p.report_json.read_text())
    text = json.dumps(report)
    assert "missing_control" in text and str(root / "ref2" / "item_4") in text and "reference 2" in text
    spec = read_spec(p.latent_spec(p.shard_names("latents")[0]))
    assert sorted(it["path"].rsplit("/", 1)[-1] for it in spec["items"]) == [f"item_{i}.png" for i in range(4)]
    for it in spec["items"]:  # both references are in each latent entry (and so in its key)
        assert sorted(it["aux"]) == ["control", "control2"]
        assert it["aux"]["control2"]["path"].startswith(str(root / "ref2"))


def test_cached_text_is_the_pipelines_prompt_with_both_references(run):
    cfg, p, _ = run
    pipe = get_family(cfg.model).load_pipeline()
    assert isinstance(pipe, QwenImageEditPlusPipeline)
    spec = read_spec(p.text_spec(p.shard_names("text")[0]))
    shard = TextShard(p.text_shard(p.shard_names("text")[0]))
    embeds, masks = shard.read("prompt_embeds"), shard.read("prompt_embeds_mask")
    by_id = {item_id: r for r, item_id in enumerate(shard.ids)}
    for item in spec["items"][:2]:
        assert [c["path"].rsplit("/", 2)[-2] for c in item["control"]] == ["ref1", "ref2"]
        images = []
        for c in item["control"]:  # what QwenImageEditPlusPipeline.__call__ does with each reference
            image = Image.open(c["path"]).convert("RGB")
            w, h = calculate_dimensions(CONDITION_IMAGE_SIZE, image.size[0] / image.size[1])
            images.append(pipe.image_processor.resize(image, h, w))
        with torch.no_grad():
            expected, _ = pipe.encode_prompt(item["caption"], image=images, device=torch.device("cpu"))
        r, n = by_id[item["id"]], expected.shape[1]
        assert masks[r].sum() == n and masks[r][:n].all()
        torch.testing.assert_close(torch.from_numpy(embeds[r][:n].copy()), expected[0], rtol=1e-5, atol=1e-5)
        assert not np.any(embeds[r][n:])


def test_references_are_the_pipelines_tokens_and_the_lora_loads(run):
    cfg, p, _ = run
    family = get_family(cfg.model)
    batch = CachedDataset.from_run(p).collate([0, 1])
    control = batch["control_latents"]
    assert control.shape[2] == 2  # [B, C, R, h, w]: one frame per reference
    pipe = family.load_pipeline()
    assert pipe.transformer.config.zero_cond_t
    tokens, shapes = family.reference_tokens(control)
    _, image_latents = pipe.prepare_latents([control[:, :, k:k + 1] for k in range(2)], 2,
                                            pipe.transformer.config.in_channels // 4, 32, 32, torch.float32,
                                            torch.device("cpu"), torch.Generator().manual_seed(0))
    torch.testing.assert_close(tokens, image_latents)
    h, w = batch["latents"].shape[-2:]
    (length, img_shapes, base), loss = _outputs(family, pipe.transformer, batch)
    assert length == 3 * (h // 2) * (w // 2)  # the target's tokens, then each reference's
    assert shapes == [(1, h // 2, w // 2)] * 2 and img_shapes == [[(1, h // 2, w // 2)] * 3] * 2
    for k in range(2):  # each reference conditions the prediction
        other = control.clone()
        other[:, :, k] = 0
        assert not torch.allclose(loss, _outputs(family, pipe.transformer, batch, control=other)[1])
    pipe.load_lora_weights(str(p.export_diffusers))
    (_, _, loaded), _ = _outputs(family, pipe.transformer, batch)
    (_, _, expected), _ = _outputs(family, apply_adapter(family.load_denoiser(), p.adapter_dir), batch)
    assert (loaded - base).abs().max() > 1e-5, "the LoRA does not change the output"
    torch.testing.assert_close(loaded, expected, rtol=1e-5, atol=1e-5)


# -- configuration errors (no run) -------------------------------------------------------------------


def _config(tmp_path, *datasets, variant=2509):  # a number, as YAML reads `variant: 2509`
    return parse_config({"output_dir": str(tmp_path / "run"),
                         "model": {"family": "qwenimage-edit", "flavor": "tiny", "variant": variant},
                         "datasets": list(datasets)})


def test_reference_lists_are_checked(tmp_path):
    ds = {"name": "a", "path": str(tmp_path / "a"), "control_path": [str(tmp_path / f"r{k}") for k in range(5)]}
    with pytest.raises(ValueError, match=r"control_path: give 1 to 4 references, not 5"):
        _config(tmp_path, ds)
    ds["control_path"] = [str(tmp_path / "r"), str(tmp_path / "r")]
    with pytest.raises(ValueError, match="a reference is named twice"):
        _config(tmp_path, ds)
    two = {"name": "a", "path": str(tmp_path / "a"), "control_path": [str(tmp_path / "r1"), str(tmp_path / "r2")]}
    one = {"name": "b", "path": str(tmp_path / "b"), "control_path": str(tmp_path / "r3")}
    with pytest.raises(ValueError, match=r"same number of references; they have \{'a': 2, 'b': 1\}"):
        _config(tmp_path, two, one)
    cfg = _config(tmp_path, two)
    assert cfg.model.variant == "2509"
    assert cfg.datasets[0].aux_roles() == ["control", "control2"]
    assert cfg.datasets[0].aux_source("control2") == (str(tmp_path / "r2"), None, "control_path[1]")


def test_plain_edit_refuses_several_references(tmp_path):
    from diffpipe import stages
    from diffpipe.paths import RunPaths

    ds = {"name": "a", "path": str(tmp_path / "a"), "control_path": [str(tmp_path / "r1"), str(tmp_path / "r2")]}
    cfg = _config(tmp_path, ds, variant=None)
    with pytest.raises(ValueError, match=r"2 reference images per item, but this model \(qwenimage-edit\) takes at "
                                         "most 1; several references are for Qwen-Image-Edit `variant: 2509"):
        stages.plan(cfg, RunPaths(tmp_path / "run"))


def test_plus_variants_and_published_sizes():
    plain = get_family(ModelConfig(family="qwenimage-edit"))
    plus = get_family(ModelConfig(family="qwenimage-edit", variant="2509"))
    assert (plain.max_references, plus.max_references) == (1, 4)
    assert plain.text_identity() != plus.text_identity()
    assert not plus._denoiser_config.get("zero_cond_t")
    from diffpipe.families.published import for_family

    sized = {s.name for s in for_family("qwenimage-edit") if plus.sizes(s)}
    assert sized == {"qwen-image-edit-2509"}
    assert {s.name for s in for_family("qwenimage-edit") if plain.sizes(s)} == {"qwen-image-edit"}


def test_a_local_folder_tells_its_variant(tmp_path):
    get_family(ModelConfig(family="qwenimage-edit", variant="2511")).load_pipeline().save_pretrained(tmp_path)
    family = get_family(ModelConfig(family="qwenimage-edit", flavor="local", path=str(tmp_path)))
    assert family.variant == "2511" and family._denoiser_config["zero_cond_t"]
    assert isinstance(family.load_pipeline(), QwenImageEditPlusPipeline)
    with pytest.raises(ValueError, match=f"model.variant '2509': the folder {tmp_path} holds Qwen-Image-Edit-2511"):
        get_family(ModelConfig(family="qwenimage-edit", flavor="local", path=str(tmp_path), variant="2509"))


def test_the_estimate_sizes_every_reference():
    from diffpipe.estimate import estimate_memory

    def estimate(control_path):
        cfg = parse_config({"model": {"family": "qwenimage-edit", "variant": 2509},
                            "datasets": [{"name": "d", "path": "data", "resolution": 256, "control_path": control_path}],
                            "train": {"batch_size": 1, "precision": "bf16"}})
        return estimate_memory(cfg, model="qwen-image-edit-2509", rank=16)

    one, three = estimate("r1"), estimate(["r1", "r2", "r3"])
    # 256 target tokens, then 256 per reference, beside 1480 text tokens: each block's joint sequence grows
    # from 1992 to 2504 tokens (x1.26), and the activations with it.
    assert 1.2 * one.activation_bytes < three.activation_bytes < 1.5 * one.activation_bytes
    assert three.param_bytes == one.param_bytes
