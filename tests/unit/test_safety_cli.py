"""The CLI's error printer on hostile text, and OS errors (full disk, read-only) as clear messages (#14).

Square brackets in a path or value are rich markup to a console: "[/x]" crashed the
printer and "[bold]" vanished from the message. A full disk or a read-only file system
gave a traceback naming no file.
"""

from __future__ import annotations

import errno
import io
import os
import shlex
import subprocess
import sys

import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner

from diffpipe.cli import app
from diffpipe.paths import RunPaths
from diffpipe.runner import RunSummary, _print_summary

runner = CliRunner()


@pytest.mark.parametrize("tag", ["[/x]", "[bold]b[/bold]", "[red]"])
def test_error_text_with_square_brackets_is_printed_verbatim(tmp_path, tag):
    missing = tmp_path / f"dir {tag}" / "c.yaml"
    result = runner.invoke(app, ["plan", "--config", str(missing)])
    assert result.exit_code == 2, f"{result.output}\n{result.exception!r}"
    assert "config error:" in result.output
    assert str(missing) in result.output, result.output


def test_config_value_with_square_brackets_is_printed_verbatim(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"output_dir": "run", "datasets": [{"name": "d", "path": "x"}],
                                   "train": {"batch_size": "[/x][bold]4"}}))
    result = runner.invoke(app, ["plan", "--config", str(cfg)])
    assert result.exit_code == 2, f"{result.output}\n{result.exception!r}"
    assert "train.batch_size" in result.output and "[/x][bold]4" in result.output, result.output


def test_run_summary_prints_paths_with_square_brackets(tmp_path):
    out = io.StringIO()
    console = Console(file=out, width=60)
    root = tmp_path / "run [/x] [bold]b"
    _print_summary(console, RunSummary(0, ["train"], {"train": 1.0}, 1.0), RunPaths(root))
    _print_summary(console, RunSummary(1, [], {}, 1.0), RunPaths(root))
    text = out.getvalue()
    assert f"{root / 'export'}" in text and f"{root / 'logs'}" in text, text


def _config(tmp_path, output_dir):
    cfg = tmp_path / "c.yaml"
    (tmp_path / "data").mkdir(exist_ok=True)
    cfg.write_text(yaml.safe_dump({"output_dir": str(output_dir),
                                   "datasets": [{"name": "d", "path": str(tmp_path / "data")}]}))
    return cfg


@pytest.mark.parametrize(("code", "advice"), [(errno.ENOSPC, "free space"), (errno.EACCES, "permissions"),
                                              (errno.EROFS, "read-only")])
def test_os_error_names_the_file_and_what_to_do(tmp_path, monkeypatch, code, advice):
    """A full disk cannot be made on every machine: the write raises the OSError the kernel would."""
    import diffpipe.data.cache.plan

    target = tmp_path / "run" / "plan" / "latents" / "s0000.json"

    def full_disk(*args, **kwargs):
        raise OSError(code, os.strerror(code), str(target))

    monkeypatch.setattr(diffpipe.data.cache.plan, "make_plan", full_disk)
    result = runner.invoke(app, ["plan", "--config", str(_config(tmp_path, tmp_path / "run"))])
    assert result.exit_code == 1, f"{result.output}\n{result.exception!r}"
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert str(target) in result.output and os.strerror(code) in result.output and advice in result.output


@pytest.fixture
def small_fs(tmp_path):
    """A real 32 KiB file system (tmpfs; needs root): a full disk, and a read-only one."""
    mounts = []

    def mount(name, *options):
        where = tmp_path / name
        where.mkdir()
        opts = ",".join(["size=32k", "nr_inodes=64", *options])
        if subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True).returncode:
            pytest.skip("cannot mount a tmpfs here (needs root); the monkeypatched test covers the message")
        mounts.append(where)
        return where

    yield mount
    for where in mounts:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.parametrize(("options", "reason", "advice"), [
    ((), "No space left on device", "free space"),
    (("ro",), "Read-only file system", "read-only"),
])
def test_real_full_or_read_only_disk_is_a_clear_error(small_fs, options, reason, advice):
    fs = small_fs("fs", *options)
    result = subprocess.run([sys.executable, "-m", "diffpipe", "demo-data", str(fs / "data"), "--n", "200",
                             "--size", "64"], capture_output=True, text=True, timeout=600)
    err = result.stderr
    assert result.returncode == 1, err
    assert "Traceback" not in err, err
    assert reason in err and advice in err, err


def test_unexpected_error_is_named_without_a_traceback(tmp_path, monkeypatch):
    import diffpipe.data.cache.plan

    def bug(*args, **kwargs):
        raise KeyError("width")

    monkeypatch.setattr(diffpipe.data.cache.plan, "make_plan", bug)
    result = runner.invoke(app, ["plan", "--config", str(_config(tmp_path, tmp_path / "run"))])
    assert result.exit_code == 1
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "unexpected KeyError" in result.output and "DIFFPIPE_DEBUG=1" in result.output
    monkeypatch.setenv("DIFFPIPE_DEBUG", "1")
    assert isinstance(runner.invoke(app, ["plan", "--config", str(_config(tmp_path, tmp_path / "run"))]).exception,
                      KeyError)


def test_output_dir_with_braces_is_refused_by_name(tmp_path):
    """Snakemake reads "{x}" in a path as a wildcard: refused before it starts, naming the key."""
    result = runner.invoke(app, ["run", "-n", "--config", str(_config(tmp_path, tmp_path / "run{shard}"))])
    assert result.exit_code == 2, result.output
    assert "output_dir" in result.output and "run{shard}" in result.output


def test_train_launcher_is_split_and_each_word_quoted():
    from types import SimpleNamespace

    from diffpipe.workflow import launcher_args

    mpi = "srun --kill-on-bad-exit=1 --export 'A=$(touch PWNED)' `x`;y"
    assert shlex.split(launcher_args(None, SimpleNamespace(mpi=mpi))) == shlex.split(mpi)
    assert launcher_args(None, SimpleNamespace(mpi="")) == ""
    with pytest.raises(ValueError, match="resources.mpi"):
        launcher_args(None, SimpleNamespace(mpi="srun 'open"))


def test_run_folder_lock_is_exclusive_and_names_the_holder(tmp_path, monkeypatch):
    from diffpipe import runlock

    run = tmp_path / "run"
    runlock.check_free(run, runlock.RUN_LOCK, "diffpipe run")  # no lock file yet
    with runlock.hold(run, runlock.RUN_LOCK, "diffpipe run") as path:
        with pytest.raises(runlock.FolderLocked, match=f"pid {os.getpid()}") as err:
            with runlock.hold(run, runlock.RUN_LOCK, "diffpipe run"):
                pass
        assert str(run) in str(err.value)
        with pytest.raises(runlock.FolderLocked, match="in use by a diffpipe run"):
            runlock.check_free(run, runlock.RUN_LOCK, "diffpipe run")
        runlock.check_free(run, runlock.TRAIN_LOCK, "diffpipe train")
        # What the run's own jobs see: the run lock held for them, the train lock theirs to take.
        monkeypatch.setenv(runlock.HELD_ENV, runlock.held_env(path))
        runlock.check_free(run, runlock.RUN_LOCK, "diffpipe run")
        with runlock.hold(run, runlock.TRAIN_LOCK, "diffpipe train") as train:
            monkeypatch.setenv(runlock.HELD_ENV, runlock.held_env(train))  # and its ranks' view
            with runlock.hold(run, runlock.TRAIN_LOCK, "diffpipe train"), runlock.hold(run, runlock.RUN_LOCK, "x"):
                pass
    monkeypatch.delenv(runlock.HELD_ENV)
    with runlock.hold(run, runlock.RUN_LOCK, "diffpipe run"):
        pass  # released on exit


def test_slurm_profile_passes_job_commands_as_scripts():
    """With sbatch --wrap="...", the submitting shell expanded $(...) in a config or output path
    (shlex's single quotes mean nothing inside double quotes); a script on stdin is run as written."""
    from diffpipe.paths import REPO_ROOT

    profile = yaml.safe_load((REPO_ROOT / "profiles" / "slurm" / "config.yaml").read_text())
    assert profile["slurm-pass-command-as-script"] is True
