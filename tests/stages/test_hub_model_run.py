"""The whole workflow on a model named by Hugging Face id, offline, from a hub cache in the hub's layout."""

from __future__ import annotations

import json

import pytest
import yaml
from hubcache import add_snapshot
from safetensors import safe_open
from stage_cli import in_process
from typer.testing import CliRunner

from diffpipe.cli import app
from diffpipe.config import ModelConfig
from diffpipe.data.dataset.demo import write_demo_dataset
from diffpipe.families import get_family
from diffpipe.paths import RunPaths
from diffpipe.training.engine import free_port

REPO = "some-org/tiny-model"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-run")
    folder = root / "tiny-sd"
    get_family(ModelConfig(family="sd", flavor="tiny")).load_pipeline().save_pretrained(folder)
    add_snapshot(root / "hub", REPO, folder, "e" * 40)
    write_demo_dataset(root / "data", n=4, size=32)
    env = {"HF_HUB_CACHE": str(root / "hub"), "HF_HUB_OFFLINE": "1", "DIFFPIPE_CACHE": str(root / "store")}
    return root, env


def _config(root, model: dict) -> str:
    cfg = {"output_dir": str(root / "run"), "model": model,
           "datasets": [{"name": "d", "path": str(root / "data"), "resolution": 32}],
           "cache": {"shards": 1}, "train": {"max_steps": 2, "batch_size": 2, "save_every_epochs": 0,
                                              "lora": {"rank": 4, "alpha": 4}, "eval": {"quantiles": []}},
           "export": {"formats": ["diffusers"]}}
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_the_stages_run_on_an_id_offline(setup):
    """validate → plan → cache → train → export through the real CLI (in process), the model named by id only."""
    root, env = setup
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
                           "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
            mp.setenv(key, value)
        mp.chdir(root)
        c = _config(root, {"path": REPO})
        paths = RunPaths(root / "run")

        def run(*args):
            result = CliRunner().invoke(app, list(args))
            assert result.exit_code == 0, f"diffpipe {' '.join(args)}:\n{result.output}\n{result.exception!r}"

        run("validate", "-c", c)
        run("plan", "-c", c)
        for shard in paths.shard_names("latents"):
            run("cache", "latents", "-c", c, "--shard", shard)
            run("cache", "text", "-c", c, "--shard", shard)
        run("train", "-c", c)
        run("export", "-c", c)
    assert len(paths.metrics.read_text().splitlines()) == 2
    with safe_open(str(paths.export_diffusers), framework="pt") as f:
        base = json.loads(f.metadata()["diffpipe.base_model"])
    assert base["path"] == REPO and base["family"] == "sd"  # the export names the id, not the cache folder


def test_a_missing_id_is_a_clean_usage_error(setup):
    root, env = setup
    result = in_process("validate", "-c", _config(root, {"path": "some-org/absent"}), env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "'some-org/absent/model_index.json': not in the hub cache" in result.stderr
    assert str(root / "hub") in result.stderr and "Traceback" not in result.stderr
