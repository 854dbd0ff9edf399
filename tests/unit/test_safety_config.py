"""Issue #14, items 2, 10 and 12: the config refuses what would lose data, pass silently or crash later.

2: output_dir, cache.dir and the dataset folders must not overlap (resolved paths, links followed).
10: a duplicate YAML key is an error naming the key and its line, never a silent override.
12: every number is strictly typed, finite and bounded; path strings are not empty. Errors name the key.
"""

from __future__ import annotations

import copy
import json
import math
import re

import pytest
import yaml

from diffpipe import config as dc
from diffpipe.config import ConfigError, json_schema, load_config, parse_config
from diffpipe.paths import REPO_ROOT, SCHEMA_FILE

BASE = {"output_dir": "runs/x", "datasets": [{"name": "d", "path": "data"}]}


def _with(base: dict, key: str, value) -> dict:
    """``base`` with the dotted ``key`` (``datasets[0].weight``, ``train.lora.rank``) set to ``value``."""
    data = copy.deepcopy(base)
    parts = [int(p) if p.isdigit() else p for p in re.findall(r"[^.\[\]]+", key)]
    node = data
    for part, nxt in zip(parts, parts[1:], strict=False):
        if isinstance(part, int):
            node.extend({} for _ in range(part + 1 - len(node)))  # an entry of a list the base leaves empty
            node = node[part]
        else:
            node = node.setdefault(part, [] if isinstance(nxt, int) else {})
    node[parts[-1]] = value
    return data


def _stderr(result) -> str:
    """The command's stderr with rich's line wrapping undone."""
    return " ".join(result.stderr.split())


def _refused(data: dict) -> str:
    with pytest.raises(ConfigError) as err:
        parse_config(data, "c.yaml")
    return str(err.value)


# -- item 12: strict, finite, bounded values ----------------------------------------------------------

# (key, bad value, text the message must show, whether the JSON schema (Snakemake) can refuse it too)
BAD_VALUES = [
    ("train.max_steps", -5, "-5", True),
    ("datasets[0].weight", math.inf, "inf", True),  # above the weight's maximum
    ("cache.shards", 1e9, "1000000000.0", True),  # above the maximum
    ("cache.shards", 10**9, "1000000000", True),
    ("cache.shards", 2.0, "2.0", False),  # JSON Schema counts 2.0 as an integer
    ("train.epochs", True, "True", True),
    ("output_dir", "", "''", True),
    ("output_dir", "   ", "'   '", True),
    ("train.zero_stage", True, "True", True),
    ("train.objective.logit_mean", math.nan, "nan", False),  # jsonschema has no way to refuse NaN
    ("train.lr", "1e-4", "'1e-4'", True),  # YAML 1.1 reads 1e-4 as text
    ("train.lr", True, "True", True),
    ("datasets[0].resolution", 10**6, "1000000", True),
    ("datasets[0].repeats", 10**9, "1000000000", True),
    ("cache.workers", 10**6, "1000000", True),
    ("sample.prompts", [], "[]", True),
    ("validation.aspect_range", [0.5, math.inf], "inf", True),
    ("datasets[0].aspect_ratios", [math.inf], "inf", True),
    ("model.seed", -1, "-1", True),
    ("datasets[0].flip", 1, "1", True),
    ("train.lora.targets", [], "[]", True),
    ("datasets[0].path", "", "''", True),
    ("cache.dir", "", "''", True),
    ("sample.images", [""], "''", True),
    ("train.pipeline_split", [0], "0", True),
    ("train.eval.quantiles", [0.5, math.nan], "nan", False),
]


@pytest.mark.parametrize(("key", "value", "shown", "schema"), BAD_VALUES, ids=lambda v: str(v)[:20])
def test_bad_value_is_refused_naming_key_and_value(key, value, shown, schema):
    msg = _refused(_with(BASE, key, value))
    assert key in msg, msg
    assert shown in msg, msg
    assert "Value error" not in msg and "(root)" not in msg


@pytest.mark.parametrize(("key", "value", "shown", "schema"), [c for c in BAD_VALUES if c[3]],
                         ids=lambda v: str(v)[:20])
def test_snakemake_schema_agrees(key, value, shown, schema):
    """What the schema can express, it refuses too: Snakemake's check says the same as diffpipe's."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA_FILE.read_text()))
    assert list(validator.iter_errors(_with(BASE, "output_dir", "runs/x")))  == []
    assert list(validator.iter_errors(_with(BASE, key, value))), f"the schema accepts {key}: {value!r}"


def test_yaml_text_for_a_number_is_refused_with_a_hint(tmp_path):
    """PyYAML (YAML 1.1) reads `1e9` and `1e-4` as text; Snakemake's loader too, so both must refuse them."""
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(BASE) + "cache: {shards: 1e9}\ntrain: {lr: 1e-4}\n")
    with pytest.raises(ConfigError) as err:
        load_config(f)
    msg = str(err.value)
    assert "cache.shards" in msg and "'1e9'" in msg and "whole number" in msg
    assert "train.lr" in msg and "'1e-4'" in msg and "1.0e-4" in msg  # how to write it so YAML reads a number


def _numeric_fields():
    """(dotted key, "integer" or "number", wrap) for every numeric field in the schema."""
    schema = json_schema()
    defs = schema["$defs"]

    def deref(s):
        return defs[s["$ref"].rsplit("/", 1)[1]] if "$ref" in s else s

    def walk(props, prefix):
        for name, spec in props.items():
            key = f"{prefix}{name}"
            opts = [deref(o) for o in spec.get("anyOf", [spec])]
            if any(o.get("type") == "string" for o in opts):
                continue  # a name YAML may read as a number (`model.variant: 2.1`): text, not a count
            for opt in opts:
                if "properties" in opt:
                    yield from walk(opt["properties"], key + ".")
                elif opt.get("type") == "array":
                    items = [deref(i) for i in opt.get("prefixItems", [])] or [deref(opt.get("items", {}))]
                    n = len(opt.get("prefixItems", [])) or 1
                    if "properties" in items[0]:
                        yield from walk(items[0]["properties"], key + "[0].")
                    elif items[0].get("type") in ("integer", "number"):
                        yield key, items[0]["type"], items[0], (lambda v, n=n: [v] * n)
                elif opt.get("type") in ("integer", "number"):
                    yield key, opt["type"], opt, (lambda v: v)

    yield from walk(schema["properties"], "")


NUMERIC = list(_numeric_fields())


def test_the_sweep_sees_every_section():
    keys = {k for k, *_ in NUMERIC}
    assert {"train.max_steps", "datasets[0].weight", "cache.shards", "train.lora.rank", "train.eval.quantiles",
            "validation.aspect_range", "sample.guidance_scale", "train.objective.shift"} <= keys
    assert len(keys) > 50


@pytest.mark.parametrize(("key", "kind", "spec", "wrap"), NUMERIC, ids=[k for k, *_ in NUMERIC])
def test_every_numeric_field_is_strict_and_finite(key, kind, spec, wrap):
    bad = [True, 1.5, "3"] if kind == "integer" else [math.inf, -math.inf, math.nan, True, "0.5"]
    for value in bad:
        msg = _refused(_with(BASE, key, wrap(value)))
        assert key in msg, (value, msg)
    if kind == "integer":  # a count, size or seed: a huge value is a mistake
        assert "maximum" in spec, f"{key} has no upper bound"
        msg = _refused(_with(BASE, key, wrap(spec["maximum"] + 1)))
        assert key in msg


def test_demo_and_example_configs_pass_the_schema():
    import jsonschema

    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA_FILE.read_text()))
    for f in sorted((REPO_ROOT / "config").glob("*.yaml")):
        assert not list(validator.iter_errors(yaml.safe_load(f.read_text()))), f
        load_config(f)


def test_cli_bad_number_exits_2_without_traceback(tmp_path, cli):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(_with(_paths(tmp_path), "train.max_steps", -5)))
    result = cli("run", "-c", str(cfg), "-n")
    assert result.returncode == 2, result.stderr
    err = _stderr(result)
    assert "train.max_steps" in err and "(got -5)" in err
    assert "Traceback" not in err


# -- item 2: no overlap between output_dir, cache.dir and the dataset folders --------------------------


def _paths(root) -> dict:
    (root / "data" / "samples").mkdir(parents=True, exist_ok=True)
    return {"output_dir": str(root / "runs" / "demo"), "datasets": [{"name": "d", "path": str(root / "data")}]}


@pytest.fixture
def tree(tmp_path, monkeypatch):
    (tmp_path / "data" / "samples").mkdir(parents=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "data")
    monkeypatch.chdir(tmp_path)  # relative paths start at the working folder, as in `diffpipe run`
    return tmp_path


OVERLAPS = [
    # (patch, the two keys the message names)
    ({"output_dir": "data"}, ("output_dir", "datasets[0].path")),
    ({"output_dir": "data/samples"}, ("output_dir", "datasets[0].path")),  # the report's case
    ({"output_dir": "data/samples/../samples/"}, ("output_dir", "datasets[0].path")),
    ({"output_dir": "."}, ("output_dir", "datasets[0].path")),  # the dataset inside the run folder
    ({"output_dir": "link/run"}, ("output_dir", "datasets[0].path")),  # through a symbolic link
    ({"output_dir": "TMP/data/run"}, ("output_dir", "datasets[0].path")),  # absolute against relative
    ({"output_dir": "runs/demo", "datasets": [{"name": "a", "path": "other"}, {"name": "b", "path": "runs"}]},
     ("output_dir", "datasets[1].path")),
    ({"output_dir": "runs/demo", "datasets": [{"name": "d", "path": "data", "mask_path": "runs/demo/masks"}]},
     ("output_dir", "datasets[0].mask_path")),
    ({"output_dir": "other", "datasets": [{"name": "d", "path": "data", "control_path": "other"}]},
     ("output_dir", "datasets[0].control_path")),
    ({"cache": {"dir": "data"}}, ("cache.dir", "datasets[0].path")),
    ({"cache": {"dir": "link/store"}}, ("cache.dir", "datasets[0].path")),
    ({"cache": {"dir": "."}}, ("cache.dir", "datasets[0].path")),
    ({"cache": {"dir": "other/c"}, "datasets": [{"name": "d", "path": "data", "control_path": "other"}]},
     ("cache.dir", "datasets[0].control_path")),
    # Siblings: a store, a model or a LoRA inside a run folder that a rerun replaces; the run inside the model.
    ({"cache": {"dir": "runs/demo/plan/store"}}, ("cache.dir", "runs/demo/plan")),
    ({"train": {"lora": {"init_from": "runs/demo/train/adapter"}}}, ("train.lora.init_from", "runs/demo/train")),
    ({"sample": {"images": ["runs/demo/samples/start.png"]}}, ("sample.images[0]", "runs/demo/samples")),
    ({"model": {"flavor": "local", "path": "other"}, "output_dir": "other/run"}, ("output_dir", "model.path")),
]


@pytest.mark.parametrize(("patch", "keys"), OVERLAPS, ids=lambda v: str(v)[:60])
def test_overlapping_folders_are_refused(tree, patch, keys):
    patch = json.loads(json.dumps(patch).replace("TMP", str(tree)))
    msg = _refused({**BASE, "output_dir": "runs/demo", **patch})
    for key in keys:
        assert key in msg, msg
    assert msg.count(str(tree)) >= 2, msg  # both folders, resolved (and the keys)


ALLOWED = [
    {"cache": {"dir": "runs/demo/store"}},  # inside the run folder, like the default
    {"cache": {"dir": "runs/demo"}},
    {"cache": {"dir": "runs"}},  # the run folder inside the store folder: no dataset involved
    {"output_dir": "data2"},  # a name starting like the dataset's is not inside it
    {"datasets": [{"name": "a", "path": "data"}, {"name": "b", "path": "data/samples"}]},
    {"datasets": [{"name": "d", "path": "data", "mask_path": "data/samples"}]},
    {"datasets": [{"name": "d", "path": "data", "eval_files": ["samples/a.png", "TMP/data/b.png"]}]},
    {"model": {"flavor": "local", "path": "runs/demo/models/sd"}},  # a model kept beside the run's folders
    {"train": {"lora": {"init_from": "runs/first/export/peft"}}},  # another run's LoRA
]


@pytest.mark.parametrize("patch", ALLOWED, ids=lambda v: str(v)[:60])
def test_separate_folders_are_accepted(tree, patch):
    patch = json.loads(json.dumps(patch).replace("TMP", str(tree)))
    parse_config({**BASE, "output_dir": "runs/demo", **patch})


@pytest.mark.parametrize(("field", "value"), [
    ("eval_files", ["../runs/demo/samples/x.png"]),
    ("eval_files", ["TMP/runs/demo/x.png"]),
    ("eval_files", [""]),
    ("metadata", "../runs/demo/metadata.csv"),
    ("metadata", "TMP/other/metadata.csv"),
])
def test_dataset_files_stay_inside_the_dataset(tree, field, value):
    value = json.loads(json.dumps(value).replace("TMP", str(tree)))
    msg = _refused({**BASE, "output_dir": "runs/demo", "datasets": [{"name": "d", "path": "data", field: value}]})
    assert f"datasets[0].{field}" in msg, msg


def test_relative_paths_start_at_the_given_base(tree):
    data = {"output_dir": "data/run", "datasets": [{"name": "d", "path": str(tree / "other" / "data")}]}
    parse_config(data)  # from the working folder: tree/data/run, apart from tree/other/data
    with pytest.raises(ConfigError, match="output_dir"):
        parse_config(data, base=tree / "other")  # `diffpipe run --workdir other`
    cfg = tree / "c.yaml"
    cfg.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="output_dir"):
        load_config(cfg, base=tree / "other")


def test_cli_run_refuses_output_inside_dataset_and_keeps_its_files(tmp_path, cli):
    data = _paths(tmp_path)
    (tmp_path / "data" / "samples" / "a.png").write_bytes(b"user file")
    data["output_dir"] = str(tmp_path / "data" / "samples")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(data))
    result = cli("run", "-c", str(cfg), "-n")
    assert result.returncode == 2, result.stderr
    err = _stderr(result)
    assert "output_dir" in err and "datasets[0].path" in err
    assert "Traceback" not in err
    assert [p.name for p in (tmp_path / "data" / "samples").iterdir()] == ["a.png"]


# -- item 10: duplicate keys ----------------------------------------------------------------------------

DUPLICATES = [
    ("datasets: [{name: d, path: x}]\ntrain:\n  epochs: 1\n  batch_size: 2\n  epochs: 3\n", "train.epochs", 5, 3),
    ("train: {epochs: 1}\ndatasets: [{name: d, path: x}]\ntrain: {batch_size: 2}\n", "train", 3, 1),
    ("datasets:\n  - name: a\n    path: x\n    name: b\n", "datasets[0].name", 4, 2),
    ("datasets: [{name: d, path: x}]\ntrain: {lora: {rank: 4, 'rank': 8}}\n", "train.lora.rank", 2, 2),
]


@pytest.mark.parametrize(("text", "key", "line", "first"), DUPLICATES, ids=[d[1] for d in DUPLICATES])
def test_duplicate_keys_are_refused_naming_key_and_line(tmp_path, text, key, line, first):
    f = tmp_path / "dup.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(f)
    msg = str(err.value)
    assert str(f) in msg and f"duplicate key {key!r}" in msg and f"line {line}" in msg, msg
    assert f"line {first}" in msg, msg  # where the first one is
    with pytest.raises(ConfigError, match="duplicate key"):
        dc.load_yaml(text)


def test_load_yaml_reads_text_and_files_and_keeps_merge_keys(tmp_path):
    text = "base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  x: 3\nlist: [*b, *b]\n"
    assert dc.load_yaml(text) == {"base": {"x": 1, "y": 2}, "other": {"x": 3, "y": 2},
                                  "list": [{"x": 1, "y": 2}, {"x": 1, "y": 2}]}
    f = tmp_path / "a.yaml"
    f.write_text(text)
    assert dc.load_yaml(f) == dc.load_yaml(text)
    with pytest.raises(ConfigError, match="not valid YAML"):
        dc.load_yaml("a: [unclosed")
    with pytest.raises(ConfigError, match="python/object"):  # still safe: no Python objects
        dc.load_yaml("a: !!python/object/apply:os.system ['true']")


def test_cli_duplicate_key_exits_2_without_traceback(tmp_path, cli):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(_paths(tmp_path)) + "train:\n  epochs: 1\ntrain:\n  max_steps: 3\n")
    result = cli("validate", "-c", str(cfg))
    assert result.returncode == 2, result.stderr
    err = _stderr(result)
    assert "duplicate key 'train' at line 7 (first at line 5)" in err
    assert "Traceback" not in err


def _laughs(levels: int) -> str:
    """The "billion laughs" document: each level repeats the one before ten times through aliases."""
    text = "l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
    for i in range(1, levels + 1):
        text += f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n"
    return text


@pytest.mark.parametrize(("text", "match"), [
    (_laughs(9), "alias bomb"),  # 10**10 values from 11 lines
    ("train: &t {optimizer_args: {x: *t}}\n", "contains itself"),
])
def test_alias_bombs_and_loops_are_refused(text, match):
    """Siblings of item 10 in the YAML reader: a json.dumps or digest of such a config never ends."""
    with pytest.raises(ConfigError, match=match):
        dc.load_yaml(text)
    assert dc.load_yaml(_laughs(4))["l4"][0][0][0][0] == ["lol"] * 10  # 10**5 values: still fine
