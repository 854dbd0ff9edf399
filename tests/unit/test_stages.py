"""Each stage reads only the config keys it declares, and its rule reruns exactly when one of them changes."""

import dataclasses

import pytest

from diffpipe import stages
from diffpipe import workflow as dw
from diffpipe.config import parse_config
from diffpipe.export.api import export_lora
from diffpipe.export.locate import locate
from diffpipe.families import get_family
from diffpipe.stage_inputs import (
    CacheInputs,
    ExportInputs,
    PlanInputs,
    SampleInputs,
    ValidateInputs,
    declared_keys,
)


def _cfg(tmp_path, **over):
    data = {"output_dir": str(tmp_path / "out"), "datasets": [{"name": "d", "path": str(tmp_path / "data")}], **over}
    return parse_config(data)


# (edit, the stages whose rule must rerun for it); every other stage must not.
EDITS = [
    ({"train": {"batch_size": 3}}, {"plan", "train", "bench"}),  # plan fills small buckets up to a global batch
    ({"train": {"grad_accum": 2}}, {"plan", "train", "bench"}),
    ({"train": {"lr": 0.5}}, {"train", "bench"}),
    # export rebuilds an adapter from a checkpoint; sample loads the export its kind allows
    ({"train": {"lora": {"rank": 5}}}, {"train", "export", "sample", "bench"}),
    # the model card no longer lists them; the run report shows them under the samples
    ({"sample": {"prompts": ["something else"]}}, {"sample", "report"}),
    ({"cache": {"dir": "elsewhere"}}, {"validate", "plan", "cache"}),  # discovery skips the cache folder
    ({"export": {"formats": ["diffusers", "kohya"]}}, {"export"}),
    # a trained text encoder's captions are cached as token ids; its learning rate changes training only
    ({"train": {"text_encoder": {"encoders": ["text_encoder"]}}}, {"plan", "cache", "train", "bench"}),
    ({"train": {"text_encoder": {"lr": 0.1}}}, {"train", "bench"}),
]


@pytest.mark.parametrize(("edit", "rerun"), EDITS, ids=[str(e) for e, _ in EDITS])
def test_a_config_edit_reruns_exactly_the_stages_that_read_it(tmp_path, edit, rerun):
    a, b = _cfg(tmp_path), _cfg(tmp_path, **edit)
    changed = {s for s in stages.STAGE_INPUTS if dw.stage_digest(a, s) != dw.stage_digest(b, s)}
    assert changed == rerun


def test_the_rerun_triggers_are_the_keys_each_stage_holds():
    """Each stage's part of the config (diffpipe.stage_inputs) is its rule's rerun trigger, key for key."""
    expected = {
        "validate": {"datasets", "validation", "model", "cache.dir"},
        "plan": {"datasets", "validation", "cache", "model", "train.batch_size", "train.grad_accum",
                 "train.text_encoder.encoders"},
        "cache": {"model", "cache", "train.text_encoder.encoders"},
        "train": {"model", "train"},
        "export": {"model", "export", "train.lora"},
        "sample": {"model", "sample", "train.lora"},
        "report": {"sample"},  # the rest it reads from the run's files, its rule's inputs
        "bench": {"model", "datasets", "train", "bench"},
    }
    assert {stage: set(keys) for stage, keys in stages.STAGE_INPUTS.items()} == expected
    parts = {"validate": ValidateInputs, "plan": PlanInputs, "cache": CacheInputs, "export": ExportInputs,
             "sample": SampleInputs}
    for stage, part in parts.items():
        assert declared_keys(part) == stages.STAGE_INPUTS[stage]


def test_a_stage_cannot_read_an_undeclared_key(tmp_path):
    cfg = _cfg(tmp_path)
    plan = PlanInputs.of(cfg)
    assert plan.train.batch_size == cfg.train.batch_size and plan.cache == cfg.cache
    with pytest.raises(AttributeError, match="'lr'"):
        _ = plan.train.lr
    with pytest.raises(AttributeError, match="'sample'"):
        _ = ExportInputs.of(cfg).sample
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.cache = None
    assert plan.train.text_encoder.encoders == []  # a declared field of a nested section
    with pytest.raises(AttributeError, match="'lr'"):
        _ = plan.train.text_encoder.lr


@pytest.mark.parametrize("part", [ValidateInputs, PlanInputs, CacheInputs, ExportInputs, SampleInputs])
def test_a_stage_records_its_keys_as_the_config_dumps_them(tmp_path, part):
    """What a stage may record of its config (export's metadata) is the whole config's dump cut to its keys."""
    cfg = _cfg(tmp_path, train={"lora": {"rank": 5}, "text_encoder": {"encoders": ["text_encoder"]}})
    whole = cfg.model_dump(mode="json")
    expected = {"output_dir": whole["output_dir"]}
    for key in declared_keys(part):
        src, dst, *path = whole, expected, *key.split(".")
        for name in path[:-1]:
            src, dst = src[name], dst.setdefault(name, {})
        dst[path[-1]] = src[path[-1]]
    assert part.of(cfg).model_dump(mode="json") == expected


def test_export_records_the_config_training_used_not_todays(tmp_path):
    """Export reads the run's train/config.yaml, so a later edit to any section leaves its files unchanged."""
    import yaml
    from safetensors import safe_open

    from diffpipe.paths import RunPaths
    from diffpipe.training.adapter import add_lora, lora_state_dict, peft_config, save_adapter

    trained = _cfg(tmp_path, train={"lr": 0.001, "lora": {"rank": 2, "alpha": 2}})
    run = RunPaths(trained.output_dir)
    run.train_dir.mkdir(parents=True)
    (run.train_dir / "config.yaml").write_text(yaml.safe_dump(trained.model_dump(mode="json")))
    family = get_family(trained.model)
    denoiser = family.load_denoiser()
    lcfg = peft_config(trained.train.lora, family.lora_targets(None))
    add_lora(denoiser, lcfg)
    save_adapter(run.adapter_dir, lora_state_dict(denoiser), lcfg, {"family": "sd", "flavor": "tiny"})

    edited = _cfg(tmp_path, train={"lr": 0.123, "lora": {"rank": 2, "alpha": 2}},
                  sample={"prompts": ["edited after training"]})
    cfg = ExportInputs.of(edited)
    found = locate(run.root, cfg)
    result = export_lora(found.adapter_dir, tmp_path / "x", family, ["diffusers"], config=cfg, run=found.run)
    assert "edited after training" not in result.card.read_text()
    with safe_open(str(result.files["diffusers"]), "pt") as f:
        recorded = f.metadata()["diffpipe.config"]
    assert '"lr": 0.001' in recorded.replace('"lr":0.001', '"lr": 0.001')
    assert "0.123" not in recorded and "edited after training" not in recorded
