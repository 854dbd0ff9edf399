"""`train.trackers: [wandb]` without a W&B login stops `diffpipe run` and `diffpipe train` before any work,
naming the key and the ways to log in; nothing here contacts the network."""

from __future__ import annotations

import pytest
import yaml

from diffpipe.config import ConfigError
from diffpipe.training import trackers

LOGIN_ENV = ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_DISABLED", "WANDB_BASE_URL", "NETRC")


@pytest.fixture
def no_login(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc
    for name in LOGIN_ENV:
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def test_wandb_without_a_login_is_named_with_the_fix(no_login):
    (line,) = trackers.problems(["tensorboard", "wandb"])
    assert line.startswith("train.trackers: wandb") and "wandb login" in line and "WANDB_API_KEY" in line
    assert "WANDB_MODE=offline" in line


@pytest.mark.parametrize("how", ["key", "netrc", "netrc_env", "offline", "disabled", "other_host"])
def test_a_login_or_offline_mode_is_enough(no_login, monkeypatch, how):
    home = no_login / "home"
    home.mkdir()
    entry = "machine {} login user password " + "k" * 40 + "\n"
    if how == "key":
        monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    elif how == "netrc":
        (home / ".netrc").write_text(entry.format("api.wandb.ai"))
    elif how == "netrc_env":
        (no_login / "mynetrc").write_text(entry.format("api.wandb.ai"))
        monkeypatch.setenv("NETRC", str(no_login / "mynetrc"))
    elif how == "other_host":  # a W&B server of one's own, logged in with `wandb login --host`
        monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
        (home / ".netrc").write_text(entry.format("api.wandb.ai") + entry.format("wandb.example.org"))
    else:
        monkeypatch.setenv("WANDB_MODE", how)
    assert trackers.problems(["wandb"]) == []


def test_a_login_for_another_host_is_not_enough(no_login, monkeypatch):
    (no_login / "home").mkdir()
    (no_login / "home" / ".netrc").write_text("machine api.wandb.ai login user password " + "k" * 40 + "\n")
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    (line,) = trackers.problems(["wandb"])
    assert "wandb.example.org" in line


def test_run_stops_before_snakemake(no_login, monkeypatch):
    from diffpipe import runner

    def started(*args, **kwargs):
        raise AssertionError("Snakemake started")

    monkeypatch.setattr(runner.runproc, "run_group", started)
    config = no_login / "c.yaml"
    config.write_text(yaml.safe_dump({"output_dir": str(no_login / "run"), "datasets": [{"name": "d", "path": "d"}],
                                      "train": {"trackers": ["wandb"]}}))
    with pytest.raises(ConfigError, match="train.trackers: wandb .*wandb login"):
        runner.run_workflow(config, workdir=no_login)
    assert not (no_login / "run").exists()
