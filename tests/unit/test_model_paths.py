"""``model.path`` rules (diffpipe/hub.py): a local-looking path that does not exist, an empty or incomplete
folder and a name that is neither a folder nor a Hugging Face id are clear errors before any load or download."""

from __future__ import annotations

import json
import threading

import pytest
import yaml
from typer.testing import CliRunner

from diffpipe import hub
from diffpipe.cli import app
from diffpipe.config import ConfigError, ModelConfig
from diffpipe.families.token_counter import FamilyTokenCounter
from diffpipe.resolve import parse_config

_INDEX = {"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"],
          "vae": ["diffusers", "AutoencoderKL"], "tokenizer": ["transformers", "CLIPTokenizer"],
          "safety_checker": [None, None]}


@pytest.fixture(autouse=True)
def _no_network(tmp_path, monkeypatch):
    """Relative paths start at tmp_path; any download attempt fails the test."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # online: a download would be attempted, so must not be

    import huggingface_hub

    def refusing(read):
        def call(*args, **kwargs):  # reading the cache (local_files_only) is fine; asking the hub is not
            assert kwargs.get("local_files_only"), f"a download was attempted: {args} {kwargs}"
            return read(*args, **kwargs)
        return call

    for name in ("snapshot_download", "hf_hub_download"):
        monkeypatch.setattr(huggingface_hub, name, refusing(getattr(huggingface_hub, name)))
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", refusing(None))


def _model(path: str) -> ModelConfig:
    return ModelConfig(family="sd", flavor="local", path=path)


def _folder(root, name: str, index: dict | None, components: tuple[str, ...]):
    folder = root / name
    folder.mkdir(parents=True)
    if index is not None:
        (folder / "model_index.json").write_text(json.dumps(index))
    for c in components:
        (folder / c).mkdir()
        (folder / c / "config.json").write_text("{}")
    return folder


@pytest.mark.parametrize("value", ["ABS", "./absent", "../absent", "~/absent", "./org/name"])
def test_a_local_looking_path_that_does_not_exist_names_it(value, tmp_path):
    value = str(tmp_path / "absent") if value == "ABS" else value
    for check in (hub.resolved, hub.check_local_model):
        with pytest.raises(ConfigError, match="no such folder") as err:
            check(_model(value))
        assert f"model.path {value!r}" in str(err.value)


@pytest.mark.parametrize("value", ["absent", "a/b/c", "org/name/", "org/-bad", "org name/x"])
def test_a_name_neither_folder_nor_hub_id_is_refused_before_any_download(value):
    for check in (hub.resolved, hub.check_local_model, hub.prefetch):
        with pytest.raises(ConfigError, match="neither a folder here .* nor a Hugging Face id") as err:
            check(_model(value))
        assert repr(value) in str(err.value)


@pytest.mark.parametrize("name", ["empty", "org/name"])
def test_an_empty_folder_is_an_error(name, tmp_path):
    (tmp_path / name).mkdir(parents=True)
    for check in (hub.resolved, hub.check_local_model, hub.prefetch):
        with pytest.raises(ConfigError, match="is an empty folder") as err:
            check(_model(name))
        # A folder that shadows a hub id says so: the user may have meant the id.
        assert ("Hugging Face id" in str(err.value)) is (name == "org/name")


def test_a_file_is_not_a_model_folder(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ConfigError, match="is a file.*model.single_files"):
        hub.resolved(_model("model.safetensors"))


def test_a_folder_without_model_index_is_incomplete(tmp_path):
    _folder(tmp_path, "partial", None, ("unet",))
    assert hub.resolved(_model("partial")).path == "partial"  # estimate reads a folder of configs alone
    for check in (hub.check_local_model, hub.prefetch):
        with pytest.raises(ConfigError, match=r"model.path 'partial'.*no model_index.json"):
            check(_model("partial"))


def test_a_folder_missing_a_component_names_it(tmp_path):
    _folder(tmp_path, "sd15", _INDEX, ("unet", "tokenizer"))
    (tmp_path / "sd15" / "tokenizer" / "config.json").unlink()  # an empty component folder is missing too
    for check in (hub.check_local_model, hub.prefetch):
        with pytest.raises(ConfigError, match=r"model.path 'sd15'.* lacks the component folders tokenizer, vae") as err:
            check(_model("sd15"))
        assert "safety_checker" not in str(err.value)  # [null, null]: absent on purpose
    (tmp_path / "sd15" / "tokenizer" / "vocab.json").write_text("{}")
    (tmp_path / "sd15" / "vae").mkdir()
    (tmp_path / "sd15" / "vae" / "config.json").write_text("{}")
    hub.check_local_model(_model("sd15"))
    assert hub.prefetch(_model("sd15")) is False  # complete, and no id to fetch


def test_a_hub_shaped_name_with_no_folder_says_both(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the cache only: nothing downloads
    says = r"model.path 'org/name': no such folder in .*, and as a Hugging Face id: .* not in the hub cache"
    with pytest.raises(ConfigError, match=says):  # the config reads the id's model_index.json
        parse_config({"model": {"path": "org/name"}, "datasets": [{"name": "d", "path": "x"}]})
    cfg = ModelConfig.model_construct(family="sd", flavor="local", path="org/name")
    hub.check_local_model(cfg)  # an id: checked where it is resolved
    with pytest.raises(hub.HubError, match=says):
        hub.resolved(cfg)


@pytest.mark.parametrize("make", ["absent", "empty", "incomplete"])
def test_validate_names_the_model_problem_without_a_traceback(make, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    if make != "absent":
        _folder(tmp_path, "model", _INDEX if make == "incomplete" else None, ("unet",) if make == "incomplete" else ())
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": "./model"}, "datasets": [{"name": "d", "path": "data"}]}))
    result = CliRunner().invoke(app, ["validate", "-c", str(config)])
    assert result.exit_code == 2, result.output
    says = {"absent": "no such folder", "empty": "is an empty folder", "incomplete": "lacks the component folders"}
    assert "config error" in result.output and "model.path './model'" in result.output, result.output
    assert says[make] in result.output and "Traceback" not in result.output and "unexpected" not in result.output


def test_a_token_counter_thread_keeps_its_error_for_the_caller(monkeypatch):
    """The tokenizers load in a thread while files are probed: its failure is raised once, where they are
    needed, not printed as a thread's traceback first."""
    import diffpipe.families.token_counter

    def broken(cfg):
        raise ConfigError("model.path 'x': broken")

    monkeypatch.setattr(diffpipe.families.token_counter, "get_family", broken)
    printed = []
    monkeypatch.setattr(threading, "excepthook", printed.append)
    counter = FamilyTokenCounter(ModelConfig())
    counter.prefetch()
    counter._thread.join()
    assert printed == []
    with pytest.raises(ConfigError, match="broken"):
        counter.limits()


def test_the_offline_download_hint_quotes_what_it_pastes(monkeypatch):
    """The hint is a shell command the user pastes: a revision with a space or `;` stays one argument."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(hub.HubError) as err:
        hub.snapshot("org/name", "my branch; rm -rf x")
    assert "`huggingface-cli download org/name --revision 'my branch; rm -rf x'`" in str(err.value)


def test_run_stops_on_a_missing_model_before_snakemake(tmp_path, monkeypatch):
    from diffpipe import runner

    def started(*args, **kwargs):
        raise AssertionError("Snakemake started")

    monkeypatch.setattr(runner.runproc, "run_group", started)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"output_dir": "run", "model": {"path": "./absent"},
                                      "datasets": [{"name": "d", "path": "d"}]}))
    with pytest.raises(ConfigError, match=r"model.path './absent': no such folder"):
        runner.run_workflow(config, workdir=tmp_path)
    assert not (tmp_path / "run").exists()
