"""Running diffpipe's stages in-process in the tests: the real Typer app, one process.

Shared by the per-family end-to-end modules (``from stage_cli import invoke, rendezvous``).
"""

from __future__ import annotations

import subprocess
import traceback

import pytest
from typer.testing import CliRunner

from diffpipe.cli import app
from diffpipe.training.engine import free_port


def invoke(*args, cwd, monkeypatch):
    """``diffpipe ARGS`` in ``cwd`` through the real Typer app: the shell command's code path,
    without paying the interpreter and import start-up per stage; fails the test on a non-zero exit."""
    monkeypatch.chdir(cwd)
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, f"diffpipe {' '.join(args)} failed:\n{result.output}\n{result.exception!r}"
    return result


def rendezvous(monkeypatch: pytest.MonkeyPatch | None = None) -> pytest.MonkeyPatch:
    """A one-process DeepSpeed rendezvous (a free port) in the environment, for in-process training.

    Set through ``monkeypatch`` (a new one when None: undo it after a module fixture), so later
    tests and their subprocesses do not inherit it.
    """
    monkeypatch = monkeypatch or pytest.MonkeyPatch()
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                           WORLD_SIZE="1", LOCAL_RANK="0").items():
        monkeypatch.setenv(key, value)
    return monkeypatch


def in_process(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``diffpipe ARGS`` through the real Typer app in this process, under a one-process rendezvous (and
    ``env``), both undone after: what ``cli(...)`` checks, without a fresh interpreter's 6-8 s of CPU for the
    torch, diffusers and DeepSpeed imports. Returns what a subprocess run returns (exit code, stdout,
    stderr); an exception that escaped the app is appended to stderr. Runs that must die
    (``DIFFPIPE_FAULT``) or launch ranks (``--processes``) stay subprocesses (``cli``)."""
    assert "--processes" not in args and "DIFFPIPE_FAULT" not in (env or {}), "run those with cli()"
    return _invoke_app(args, env, with_rendezvous=True)


def starter_in_process(*args: str, env: dict[str, str] | None = None, cwd=None) -> subprocess.CompletedProcess:
    """``diffpipe ARGS`` for a command that starts processes of its own (``run``: Snakemake and its jobs;
    ``bench``: a process per point) through the real Typer app in this process, with ``env`` and in ``cwd``
    (both undone after): the processes it starts are those the shell command starts, and the command's own
    interpreter start-up (2-5 s of CPU) is saved. No rendezvous, so its children inherit none."""
    return _invoke_app(args, env, with_rendezvous=False, cwd=cwd)


def _invoke_app(args, env: dict[str, str] | None, *, with_rendezvous: bool, cwd=None) -> subprocess.CompletedProcess:
    with pytest.MonkeyPatch.context() as monkeypatch:
        if cwd is not None:
            monkeypatch.chdir(cwd)
        if with_rendezvous:
            rendezvous(monkeypatch)
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        result = CliRunner().invoke(app, list(args))
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
    return subprocess.CompletedProcess(["diffpipe", *args], result.exit_code, result.stdout, stderr)


def run_stages(config, *, cwd, monkeypatch, empty_caption: bool = False,
               then: tuple[str, ...] = ("train", "export", "sample")) -> None:
    """validate, plan, every latent and text shard (and the empty caption), then ``then``, as a run does."""
    from diffpipe.config import load_config
    from diffpipe.paths import RunPaths

    c = str(config)
    invoke("validate", "-c", c, cwd=cwd, monkeypatch=monkeypatch)
    invoke("plan", "-c", c, cwd=cwd, monkeypatch=monkeypatch)
    paths = RunPaths(load_config(config).output_dir)  # relative to cwd, where invoke just moved
    for shard in paths.shard_names("latents"):
        invoke("cache", "latents", "-c", c, "--shard", shard, cwd=cwd, monkeypatch=monkeypatch)
        invoke("cache", "text", "-c", c, "--shard", shard, cwd=cwd, monkeypatch=monkeypatch)
    if empty_caption:
        invoke("cache", "empty", "-c", c, cwd=cwd, monkeypatch=monkeypatch)
    for stage in then:
        invoke(stage, "-c", c, cwd=cwd, monkeypatch=monkeypatch)


def run_config(cfg: dict, root, name: str, **kwargs):
    """Write ``cfg`` as ``root/<name>.yaml`` and run its stages in ``root`` (:func:`run_stages`, ``kwargs``)
    under a one-process rendezvous of their own; returns the config's path."""
    import yaml

    config = root / f"{name}.yaml"
    config.write_text(yaml.safe_dump(cfg))
    monkeypatch = rendezvous()
    try:
        run_stages(str(config), cwd=root, monkeypatch=monkeypatch, **kwargs)
    finally:
        monkeypatch.undo()
    return config


def edit_outputs(family, denoiser, batch, control=None):
    """An edit family's forward on a cached batch at fixed t and noise: ``((sequence length, img_shapes,
    raw output), loss)``, the transformer's inputs seen through a hook; ``control`` replaces the batch's."""
    import torch

    seen = []
    handle = denoiser.register_forward_hook(
        lambda m, a, kw, o: seen.append((kw["hidden_states"].shape[1], kw["img_shapes"], o[0])), with_kwargs=True
    )
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            loss = family.loss(denoiser, batch["latents"], batch["text"], torch.Generator(), t=torch.tensor([0.3, 0.7]),
                               noise=noise, control=batch["control_latents"] if control is None else control)
    finally:
        handle.remove()
    return seen[0], loss
