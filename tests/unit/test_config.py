import json

import pytest
import yaml

from diffpipe.config import ConfigError, TrainConfig, json_schema, load_config, parse_config
from diffpipe.paths import REPO_ROOT, SCHEMA_FILE

MINIMAL = {"datasets": [{"name": "d", "path": "data"}]}


def test_demo_and_example_configs_parse():
    for f in sorted((REPO_ROOT / "config").glob("*.yaml")):
        cfg = load_config(f)
        assert cfg.datasets, f


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"train\.lerning_rate: unknown key"):
        parse_config({**MINIMAL, "train": {"lerning_rate": 1}}, "x.yaml")


def test_bad_value_names_key_and_value():
    with pytest.raises(ConfigError, match=r"train\.lora\.rank: .*greater than or equal to 1.*got 0"):
        parse_config({**MINIMAL, "train": {"lora": {"rank": 0}}})


def test_local_flavor_needs_path():
    with pytest.raises(ConfigError, match="model.path is required"):
        parse_config({**MINIMAL, "model": {"flavor": "local"}})


def test_duplicate_dataset_names():
    with pytest.raises(ConfigError, match="duplicate name"):
        parse_config({"datasets": [{"name": "d", "path": "a"}, {"name": "d", "path": "b"}]})


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_committed_schema_matches_models():
    """workflow/schemas/config.schema.json is generated: regenerate with `make schema`."""
    assert json.loads(SCHEMA_FILE.read_text()) == json_schema()


def test_every_field_has_a_description():
    schema = json_schema()
    missing = [
        f"{name}.{field}"
        for name, model in schema["$defs"].items()
        for field, spec in model["properties"].items()
        if not spec.get("description")
    ]
    missing += [f for f, spec in schema["properties"].items() if not spec.get("description")]
    assert not missing


def test_snakemake_validates_with_schema():
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import validate

    good = yaml.safe_load((REPO_ROOT / "config" / "demo.yaml").read_text())
    validate(good, str(SCHEMA_FILE))
    with pytest.raises(WorkflowError):
        validate({**good, "unknown_section": 1}, str(SCHEMA_FILE))


def test_readme_config_reference_is_current():
    """docs/configuration.md's table is generated: refresh with `make docs`."""
    from diffpipe.config import reference_markdown

    readme = (REPO_ROOT / "docs" / "configuration.md").read_text()
    start, end = "<!-- config-reference:start -->\n", "\n<!-- config-reference:end -->"
    assert start in readme and end in readme
    assert readme.split(start)[1].split(end)[0].strip() == reference_markdown()


@pytest.mark.parametrize(("extra", "message"), [
    ({"activation_checkpointing": False}, "block_swap needs train.activation_checkpointing"),
    ({"checkpoint_fraction": 0.5}, "checkpoint_fraction 0.5 leaves the last blocks, the swapped ones, unchecked"),
    ({"zero_stage": 3}, "block_swap works with train.zero_stage 0-2"),
    ({"pipeline_stages": 2}, "block_swap needs train.pipeline_stages: 1"),
])
def test_block_swap_refuses_what_would_keep_swapped_weights_on_the_gpu(extra, message):
    train = {"block_swap": 4, "activation_checkpointing": True, **extra}
    with pytest.raises(ValueError, match=message):
        TrainConfig(**train)
    assert TrainConfig(block_swap=4, activation_checkpointing=True, checkpoint_fraction=1).block_swap == 4


@pytest.mark.parametrize(("train", "key", "name"), [
    ({"trackers": ["tensorboard", "tensorboard"]}, r"train\.trackers", "tensorboard"),
    ({"text_encoder": {"encoders": ["text_encoder", "text_encoder"]}}, r"train\.text_encoder\.encoders", "text_encoder"),
])
def test_a_list_of_names_with_a_repeat_is_an_error_naming_the_key_and_the_repeat(train, key, name):
    with pytest.raises(ConfigError, match=rf"{key}: names '{name}' twice"):
        parse_config({**MINIMAL, "train": train})
