"""`diffpipe init` and `diffpipe validate FOLDER`: from a folder of images to a config that works."""

import json

import pytest
import yaml
from typer.testing import CliRunner

from diffpipe.cli import app
from diffpipe.config import load_config
from diffpipe.data.dataset.demo import write_demo_dataset

runner = CliRunner()


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("init")
    write_demo_dataset(root / "shapes", n=4, size=64)
    return root / "shapes"


def test_init_writes_a_commented_config_that_loads(images, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["init", str(images), "--model", "tiny:sd", "--trigger", "sks", "-o", "my.yaml"])
    assert result.exit_code == 0, result.output
    text = (tmp_path / "my.yaml").read_text()
    cfg = load_config(tmp_path / "my.yaml")
    assert (cfg.model.family, cfg.model.flavor) == ("sd", "tiny")
    ds = cfg.datasets[0]
    assert (ds.resolution, ds.aspect_ratios, ds.caption_prefix) == (64, [1.0], "sks, ")
    captions = sorted(p.read_text().strip() for p in images.glob("*.txt"))
    assert cfg.sample.prompts and all(p.startswith("sks, ") and p[5:] in captions for p in cfg.sample.prompts)
    assert "comfyui" in cfg.export.formats
    assert "total per GPU" in text and "diffpipe run -c my.yaml" in text  # the estimate, the next command


def test_init_never_replaces_a_file(images, tmp_path):
    out = tmp_path / "mine.yaml"
    out.write_text("my own notes\n")
    result = runner.invoke(app, ["init", str(images), "--model", "tiny:sd", "-o", str(out), "--no-estimate"])
    assert result.exit_code == 2 and "never replaces" in result.output
    assert out.read_text() == "my own notes\n"


@pytest.mark.parametrize("pipeline, family", [("FluxPipeline", "flux"), ("WanPipeline", "wan"),
                                              ("StableDiffusionXLPipeline", "sdxl")])
def test_init_detects_the_family_of_a_local_folder(images, tmp_path, pipeline, family):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
    out = tmp_path / "c.yaml"
    result = runner.invoke(app, ["init", str(images), "--model", str(model), "-o", str(out), "--no-estimate",
                                 "--output-dir", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    m = yaml.safe_load(out.read_text())["model"]
    assert m == {"family": family, "flavor": "local", "path": str(model)}


@pytest.mark.parametrize("model, says", [("stabilityai/sdxl-turbo", "'stabilityai/sdxl-turbo/model_index.json'"
                                                                   ": not in the hub cache"),
                                         ("tiny:nosuch", "unknown family 'nosuch'")])
def test_init_refuses_a_model_it_cannot_load(images, tmp_path, model, says, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # an id absent from an empty hub cache, never the network
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    result = runner.invoke(app, ["init", str(images), "--model", model, "-o", str(tmp_path / "c.yaml")])
    assert result.exit_code == 2 and says in result.output, result.output
    assert not (tmp_path / "c.yaml").exists()


def test_validate_a_folder_without_a_config(images, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["validate", str(images), "--no-tokens"])
    assert result.exit_code == 0, result.output
    assert "validate: report runs/validate-shapes/validate/report.html" in result.output
    assert (tmp_path / "runs/validate-shapes/validate/report.html").is_file()
    assert "Dataset validation" in result.output and "4 of 4 items kept" in result.output


def test_validate_a_folder_from_inside_it_asks_for_out(images, monkeypatch):
    monkeypatch.chdir(images)
    result = runner.invoke(app, ["validate", ".", "--no-tokens"])
    assert result.exit_code == 2 and "--out" in result.output, result.output
    assert not (images / "runs").exists()


@pytest.mark.parametrize("where, says", [("dataset", "dataset folder"), ("out", "--out"), ("output_dir", "--output-dir"),
                                         ("model", "--model")])
@pytest.mark.parametrize("brk", ["\n", "\r", "\u2028"])
def test_init_refuses_a_line_break_in_a_name_it_writes(images, tmp_path, monkeypatch, where, says, brk):
    """A name init writes into the config (comments, commands) is one line: a line break would end the
    comment and turn the rest into live YAML, or break the YAML it parses."""
    monkeypatch.chdir(tmp_path)
    odd = f"x{brk}model: {{evil: 1}}"
    dataset = tmp_path / odd if where == "dataset" else images
    if where == "dataset":
        import shutil

        shutil.copytree(images, dataset)
    out = odd if where == "out" else "c.yaml"
    args = ["init", str(dataset), "--model", odd if where == "model" else "tiny:sd", "-o", out, "--no-estimate"]
    args += ["--output-dir", odd] if where == "output_dir" else []
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and says in result.output and "line break" in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ([odd] if where == "dataset" else [])


def test_init_quotes_the_commands_it_writes(images, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["init", str(images), "--model", "tiny:sd", "-o", "my run.yaml", "--no-estimate"])
    assert result.exit_code == 0, result.output
    text = (tmp_path / "my run.yaml").read_text()
    assert "diffpipe run -c 'my run.yaml'" in text and "diffpipe doctor -c 'my run.yaml'" in text
    assert "diffpipe validate -c 'my run.yaml'" in result.output


@pytest.mark.parametrize("make, says", [("empty", "is an empty folder"), ("incomplete", "lacks the component folders vae"),
                                        ("absent", "no such folder"), ("name", "neither a folder here")])
def test_init_refuses_an_empty_or_incomplete_model_folder(images, tmp_path, monkeypatch, make, says):
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "model"
    if make in ("empty", "incomplete"):
        model.mkdir()
    if make == "incomplete":
        (model / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline",
                                                            "vae": ["diffusers", "AutoencoderKL"]}))
    value = "models" if make == "name" else str(model)
    result = runner.invoke(app, ["init", str(images), "--model", value, "--family", "sd", "-o", "c.yaml",
                                 "--no-estimate"])
    assert result.exit_code == 2 and says in result.output and "--model" in result.output, result.output
    assert not (tmp_path / "c.yaml").exists()


@pytest.mark.parametrize("gpu", ["NVIDIA GeForce RTX 4090", None])
def test_init_writes_memory_auto_for_a_detected_gpu(images, tmp_path, monkeypatch, gpu):
    """A CUDA GPU (the detection stubbed: none exists here) gets train.memory: auto; a machine without one, or the
    tiny model, keeps the memory keys by hand."""
    from diffpipe import init

    monkeypatch.setattr(init, "detected_gpu", lambda: gpu)
    model = tmp_path / "model"
    model.mkdir()
    (model / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    out = tmp_path / "c.yaml"
    result = runner.invoke(app, ["init", str(images), "--model", str(model), "-o", str(out), "--no-estimate",
                                 "--output-dir", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    cfg = load_config(out)
    assert cfg.train.memory == ("auto" if gpu else "manual")
    assert (f"detected: {gpu}" in out.read_text()) == bool(gpu)
    tiny = runner.invoke(app, ["init", str(images), "--model", "tiny:flux", "-o", str(tmp_path / "t.yaml"),
                               "--no-estimate", "--output-dir", str(tmp_path / "run2")])
    assert tiny.exit_code == 0, tiny.output
    assert load_config(tmp_path / "t.yaml").train.memory == "manual"
