"""Hostile names through the real Snakemake workflow, the run-folder lock, and --target on a stale shard (#14).

One real run (8 images, 32 px, 2 training steps) whose output_dir, config path,
dataset folder and dataset name hold spaces, both quotes, ``$(...)``, backticks,
``;``, a newline and rich markup; the tests after it share that run, in file order.
"""

from __future__ import annotations

import html
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from stage_cli import starter_in_process

from diffpipe.config import load_config
from diffpipe.data.dataset.demo import write_demo_dataset
from diffpipe.paths import REPO_ROOT, RunPaths
from diffpipe.runner import DEFAULT_PROFILE, run_workflow
from diffpipe.sbatch import dry_run_jobs
from diffpipe.workflow import RESOLVED_CONFIG, export_formats

pytestmark = pytest.mark.slow

# Each piece would run `touch PWNED` if a shell read the name unquoted; "[/x]" would crash or
# vanish if a printer read it as rich markup.
HOSTILE = "'sq' \"dq\" [/x] $(touch PWNED) `touch PWNED`; touch PWNED\nnl"
LAUNCHER_WORD = "$(touch PWNED) `touch PWNED`; touch PWNED"


def diffpipe(*args: str, cwd: Path, timeout: float = 1500) -> subprocess.CompletedProcess:
    """``diffpipe ARGS`` in ``cwd``. ``run`` runs in this process (the real Typer app; Snakemake and its jobs
    are processes as from a shell; ``timeout`` does not apply), saving an interpreter start-up; other commands
    run in a process of their own (a ``train`` that failed to refuse would otherwise train here, unlaunched)."""
    if args[0] == "run":
        return starter_in_process(*args, cwd=cwd)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "diffpipe", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def pwned(*folders: Path) -> list[Path]:
    found = []
    for folder in folders:
        found += [p for p in folder.rglob("*") if p.name == "PWNED"]
    return found


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    root = tmp_path_factory.mktemp("safety")
    work = root / "work"  # where `diffpipe run` starts; relative paths start here
    work.mkdir()
    data = root / f"data {HOSTILE}"
    write_demo_dataset(data, n=8, size=32)
    config = root / f"config {HOSTILE}" / f"c {HOSTILE}.yaml"
    config.parent.mkdir(parents=True)
    out = f"run {HOSTILE}"
    config.write_text(yaml.safe_dump({
        "output_dir": out,
        "datasets": [{"name": "d $(touch PWNED); 'q'", "path": str(data), "resolution": 32}],
        "cache": {"shards": 1},
        "train": {"epochs": 1, "batch_size": 4, "lora": {"rank": 4, "alpha": 4}},  # 2 steps
        "sample": {"prompts": ["a red circle"], "steps": 2},
    }))
    first = diffpipe("run", "-c", str(config), "--cores", "2", "--", "--resources", "gpu=2", cwd=work)
    return {"root": root, "work": work, "data": data, "config": config, "out": out, "first": first,
            "paths": RunPaths(work / out)}


def test_hostile_names_run_end_to_end_and_run_nothing(hostile):
    first, p = hostile["first"], hostile["paths"]
    assert first.returncode == 0, first.stderr[-6000:]
    for f in (p.manifest, p.adapter_file, p.export_diffusers, p.sample_grid, p.run_report):
        assert f.is_file() and f.stat().st_size > 0, f
    assert html.escape(p.root.name) in p.run_report.read_text()  # the run report shows names as text
    assert not pwned(hostile["root"], REPO_ROOT / "workflow", Path.cwd()), "a name was run as a shell command"
    assert not (REPO_ROOT / "PWNED").exists()
    # The summary prints each path as it is, on one line (copyable).
    assert str(p.export_diffusers) in first.stderr, first.stderr[-3000:]


def test_run_into_a_users_folder_with_plan_and_samples_is_refused_before_snakemake(tmp_path):
    """#38 case 1: Snakemake deletes a directory() output (plan/, samples/) before its job: refused first."""
    work = tmp_path / "work"
    work.mkdir()
    data = tmp_path / "data"
    write_demo_dataset(data, n=4, size=32)
    user = tmp_path / f"mine {HOSTILE}"
    files = {"plan/my plan $(touch PWNED).md": "plans", "samples/holiday.png": "pixels", "notes.txt": "mine"}
    for rel, text in files.items():
        (user / rel).parent.mkdir(parents=True, exist_ok=True)
        (user / rel).write_text(text)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"output_dir": str(user), "cache": {"shards": 1},
                                      "datasets": [{"name": "d", "path": str(data), "resolution": 32}]}))
    started = time.time()
    run = diffpipe("run", "-c", str(config), "--cores", "1", cwd=work, timeout=300)
    assert run.returncode == 1, run.stderr[-3000:]
    flat = " ".join(run.stderr.split())
    assert " ".join(str(user).split()) in flat and "Traceback" not in run.stderr, run.stderr
    assert "plan/my plan $(touch PWNED).md" in flat and "samples/holiday.png" in flat, run.stderr
    found = {p.relative_to(user).as_posix(): p.read_text() for p in user.rglob("*") if p.is_file()}
    assert found == files  # nothing written there (no resolved config, no lock file), nothing deleted
    assert not (work / ".snakemake").exists(), "Snakemake started"
    assert not pwned(tmp_path) and time.time() - started < 60


def _log(out: str, name: str) -> str:
    return f"{out}/logs/{name}.log"


def test_every_rule_command_parses_to_its_argv(hostile):
    """Each rule's shell command (Snakemake's dry run, every rule forced) splits into exactly the intended words."""
    work, config, out = hostile["work"], hostile["config"], hostile["out"]
    resolved = f"{out}/{RESOLVED_CONFIG}"
    launcher = f"train:mpi=\"srun --kill-on-bad-exit=1 '{LAUNCHER_WORD}'\""
    # Forcing validate would hide the cache jobs (they are known once the plan checkpoint ran): two dry runs.
    after_plan = ["--forcerun", "cache_latents", "cache_text", "cache_empty_text", "train", "export", "sample",
                  "report"]
    jobs = [job for extra in (["--forceall"], after_plan)
            for job in dry_run_jobs(config, DEFAULT_PROFILE, work, [*extra, "--set-resources", launcher])]
    argv = {f"{j.rule}/{j.wildcards.removeprefix('shard=')}".rstrip("/"): shlex.split(j.shell)
            for j in jobs if j.shell not in ("", "None")}
    tail = lambda name: [">", _log(out, name), "2>&1"]  # noqa: E731
    formats = [w for f in export_formats(load_config(config)) for w in ("--format", f)]
    want = {
        "validate": ["diffpipe", "validate", "--config", resolved, "--workers", argv["validate"][5], *tail("validate")],
        "plan": ["diffpipe", "plan", "--config", resolved, *tail("plan")],
        "cache_latents/s0000": ["diffpipe", "cache", "latents", "--config", resolved, "--shard", "s0000",
                                *tail("cache_latents/s0000")],
        "cache_text/s0000": ["diffpipe", "cache", "text", "--config", resolved, "--shard", "s0000",
                             *tail("cache_text/s0000")],
        "cache_empty_text": ["diffpipe", "cache", "empty", "--config", resolved, *tail("cache_empty_text")],
        "train": ["srun", "--kill-on-bad-exit=1", LAUNCHER_WORD, "diffpipe", "train", "--config", resolved,
                  "--processes", "1", "--auto-resume", *tail("train")],
        "export": ["diffpipe", "export", "--config", resolved, *formats, *tail("export")],
        "sample": ["diffpipe", "sample", "--config", resolved, *tail("sample")],
        "report": ["diffpipe", "report", "--config", resolved, *tail("report")],
    }
    assert argv["validate"][5].isdigit()
    assert {k: argv.get(k) for k in want} == want
    assert not pwned(hostile["root"])


def _hold(lock: Path, cwd: Path) -> subprocess.Popen:
    """Another process holding the run folder's lock file, as a running `diffpipe run` / `diffpipe train` does."""
    code = (
        "import fcntl, os, socket, sys, time\n"
        f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "os.ftruncate(fd, 0); os.pwrite(fd, f'{os.getpid()} {socket.gethostname()} {time.time():.0f}'.encode(), 0)\n"
        "print('held', flush=True); sys.stdin.read()\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def _elsewhere(hostile, tmp_path) -> tuple[Path, Path]:
    """A config in another folder naming the same run folder by its absolute path."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cfg = yaml.safe_load(hostile["config"].read_text())
    cfg["output_dir"] = str(hostile["paths"].root)
    other = elsewhere / "other.yaml"
    other.write_text(yaml.safe_dump(cfg))
    return elsewhere, other


@pytest.mark.parametrize(("held", "command"), [
    ("run", "run"),  # a second run, started from another folder
    ("train", "train"),  # a second direct train
    ("run", "train"),  # a direct train beside a run (the run's own train job is not refused: the first test)
    ("train", "run"),  # a run beside a direct train
])
def test_second_writer_on_one_run_folder_is_refused(hostile, tmp_path, held, command):
    p = hostile["paths"]
    elsewhere, other = _elsewhere(hostile, tmp_path)
    before = p.adapter_file.stat().st_mtime_ns
    holder = _hold(p.root / f".diffpipe-{held}.lock", cwd=hostile["work"])
    try:
        args = ["run", "-c", str(other), "--cores", "1"] if command == "run" else ["train", "-c", str(other)]
        second = diffpipe(*args, cwd=elsewhere)
    finally:
        holder.communicate("")
    assert second.returncode == 1, second.stderr[-3000:]
    assert str(p.root) in second.stderr and f"pid {holder.pid}" in second.stderr, second.stderr
    assert f"in use by a diffpipe {held}" in second.stderr and "Traceback" not in second.stderr
    assert p.adapter_file.stat().st_mtime_ns == before


def test_run_after_the_lock_is_released_does_nothing(hostile, tmp_path):
    elsewhere, other = _elsewhere(hostile, tmp_path)
    again = diffpipe("run", "-c", str(other), "--cores", "1", cwd=elsewhere)
    assert again.returncode == 0 and "Nothing to do" in again.stderr, again.stderr[-3000:]


def test_target_on_a_text_shard_after_a_caption_edit_rebuilds_it(hostile):
    """Last: it edits the shared dataset. validate and plan run first, then the stale shard."""
    p, work = hostile["paths"], hostile["work"]
    caption = sorted(hostile["data"].glob("*.txt"))[3]
    shard = p.text_shard("s0000")
    before = shard.stat().st_mtime_ns
    time.sleep(1.1)  # coarse file-system clocks
    caption.write_text(caption.read_text().strip() + ", sharp edges\n")
    run = run_workflow(hostile["config"], cores=1, workdir=work, targets=[str(shard.relative_to(work))])
    assert run.returncode == 0
    assert sorted(run.jobs) == ["cache_text/s0000", "plan", "validate"], run.jobs
    assert shard.stat().st_mtime_ns > before
    spec = yaml.safe_load(p.text_spec("s0000").read_text())
    assert any(item["caption"].endswith("sharp edges") for item in spec["items"])
