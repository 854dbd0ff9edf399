"""``diffpipe run``: drive the Snakemake workflow and summarise what happened."""

from __future__ import annotations

import csv
import os
import shlex
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from diffpipe import hub, runlock
from diffpipe.config import ConfigError
from diffpipe.ownership import check_run_folder
from diffpipe.paths import REPO_ROOT, SNAKEFILE, RunPaths
from diffpipe.resolve import load_config
from diffpipe.workflow import check_snakemake_paths

DEFAULT_PROFILE = REPO_ROOT / "profiles" / "default"


REGENERATE_RULES = ("cache_latents", "cache_text", "cache_empty_text")
STAGES = ("validate", "plan", "cache_latents", "cache_text", "cache_empty_text", "train", "export", "sample")


@dataclass
class RunSummary:
    returncode: int
    jobs: list[str]  # jobs that ran in this invocation, e.g. "cache_text/s0001"
    stage_seconds: dict[str, float]
    wall_seconds: float

    @property
    def jobs_ran(self) -> int:
        return len(self.jobs)


def snakemake_command(
    config: Path,
    *,
    profile: Path | None,
    cores: int | None,
    dry_run: bool,
    targets: list[str],
    extra: list[str],
    workdir: Path,
) -> list[str]:
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(SNAKEFILE), "--directory", str(workdir),
           "--configfile", str(config)]
    # Snakemake would also load profiles/default (beside the Snakefile) as the
    # workflow profile and let its set-resources replace the chosen profile's.
    cmd += ["--workflow-profile", "none"]
    if profile is not None:
        cmd += ["--profile", str(profile)]
    if cores is not None:
        cmd += ["--cores", str(cores)]
    elif profile is None:
        cmd += ["--cores", "all"]
    if dry_run:
        cmd.append("--dry-run")
    if os.environ.get("DIFFPIPE_QUIET") == "1":  # `diffpipe --quiet run`: no per-job progress (errors still show)
        cmd += ["--quiet", "progress", "rules", "host"]
    # "--" ends the options: a target must not be read as one more value of an option that
    # takes several (--resources gpu=2 plan).
    return cmd + list(extra) + (["--", *targets] if targets else [])


def run_workflow(
    config: str | Path,
    *,
    profile: str | Path | None = DEFAULT_PROFILE,
    cores: int | None = None,
    dry_run: bool = False,
    targets: list[str] = (),
    extra: list[str] = (),
    workdir: str | Path = ".",
    console: Console | None = None,
    regenerate: bool = False,
) -> RunSummary:
    """Run Snakemake on ``config``; report jobs run, stage times and where outputs are."""
    console = console or Console(stderr=True)
    config = Path(config).resolve()
    workdir = Path(workdir).resolve()
    cfg = load_config(config, base=workdir)  # fail fast with our own error before Snakemake starts
    check_snakemake_paths(cfg)
    from diffpipe.training import trackers

    if problems := trackers.problems(cfg.train.trackers):  # before the cache jobs, not after them
        raise ConfigError("\n".join(problems))
    run_paths = RunPaths(workdir / cfg.output_dir)
    check_run_folder(run_paths.root)  # before Snakemake deletes old outputs there, and before the lock file
    cmd = snakemake_command(config, profile=Path(profile) if profile else None, cores=cores, dry_run=dry_run,
                            targets=list(targets), extra=list(extra), workdir=workdir)
    # Rules call `diffpipe ...`: make sure it is this installation's.
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if not dry_run and hub.prefetch(cfg.model):
        # A Hugging Face id is downloaded here, once; the jobs read that snapshot from the cache.
        env["HF_HUB_OFFLINE"] = "1"
    if regenerate:
        # The cache jobs read this and encode every entry again; Snakemake must rerun them.
        env["DIFFPIPE_REGENERATE"] = "1"
        cmd += ["--forcerun", *REGENERATE_RULES]
    start = time.time()
    # Snakemake's own lock is per working directory: a second run on this output_dir
    # from another folder would pass it. A dry run writes nothing and is not locked.
    lock = nullcontext() if dry_run else runlock.hold(run_paths.root, runlock.RUN_LOCK, "diffpipe run",
                                                       warn=lambda m: console.print(m, markup=False, highlight=False, soft_wrap=True))
    with lock as held:
        if held is not None:
            runlock.check_free(run_paths.root, runlock.TRAIN_LOCK, "diffpipe train")
            env[runlock.HELD_ENV] = runlock.held_env(held)  # the jobs run under this lock
        rc = subprocess.call(cmd, env=env, cwd=workdir)
    wall = time.time() - start
    jobs, seconds = _benchmarks(run_paths.benchmarks, since=start)
    summary = RunSummary(rc, jobs, seconds, wall)
    if not dry_run:
        _print_summary(console, summary, run_paths)
    return summary


def _benchmarks(folder: Path, since: float) -> tuple[list[str], dict[str, float]]:
    """(jobs that ran since ``since``, seconds per stage) from Snakemake's benchmark files."""
    jobs, seconds = [], {}
    for f in sorted(folder.rglob("*.tsv")) if folder.exists() else []:
        job = str(f.relative_to(folder)).removesuffix(".tsv")
        stage = job.split("/")[0]
        with open(f) as fh:
            rows = list(csv.DictReader(fh, delimiter="\t"))
        if rows:
            seconds[stage] = seconds.get(stage, 0.0) + float(rows[-1]["s"])
        if f.stat().st_mtime >= since:
            jobs.append(job)
    order = {s: i for i, s in enumerate(STAGES)}
    seconds = dict(sorted(seconds.items(), key=lambda kv: order.get(kv[0], len(order))))
    return sorted(jobs, key=lambda j: (order.get(j.split("/")[0], len(order)), j)), seconds


def _print_summary(console: Console, s: RunSummary, p: RunPaths) -> None:
    if s.returncode != 0:
        console.print(f"[bold red]workflow failed[/] (Snakemake exit {s.returncode}); see the logs in "
                      f"{escape(str(p.root / 'logs'))}", soft_wrap=True)
        return
    if s.jobs_ran == 0:
        console.print("[bold green]Nothing to do:[/] 0 Snakemake jobs ran; every output is up to date.")
    else:
        console.print(f"[bold green]Done:[/] {s.jobs_ran} Snakemake jobs ran in {s.wall_seconds:.1f} s.")
    # The title on its own line: as a table title it wraps at the table's narrow width.
    console.print("time per stage (last run of each job, summed over shards):", highlight=False, soft_wrap=True)
    table = Table()
    table.add_column("stage")
    table.add_column("seconds", justify="right")
    for stage, sec in s.stage_seconds.items():
        table.add_row(stage, f"{sec:.1f}")
    console.print(table)
    # Paths as text (no markup: a "[" in output_dir is not a style), one line each (copyable).
    for line in (f"LoRA (diffusers):   {p.export_diffusers}",
                 f"sample images:      {p.samples_dir}  (grid: {p.sample_grid})",
                 f"TensorBoard logs:   {p.tensorboard}  (tensorboard --logdir {shlex.quote(str(p.tensorboard))})",
                 f"metrics, loss plot: {p.metrics}, {p.train_dir / 'loss.png'}",
                 f"validation report:  {p.report_html}"):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
