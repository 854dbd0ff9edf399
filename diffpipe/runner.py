"""``diffpipe run``: drive the Snakemake workflow and summarise what happened."""

from __future__ import annotations

import csv
import os
import shlex
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from diffpipe import hub, progress, runproc
from diffpipe.config import ConfigError
from diffpipe.ownership import check_run_folder
from diffpipe.paths import REPO_ROOT, SNAKEFILE, RunPaths
from diffpipe.resolve import load_config
from diffpipe.training import trackers
from diffpipe.workflow import check_snakemake_paths

DEFAULT_PROFILE = REPO_ROOT / "profiles" / "default"


REGENERATE_RULES = ("cache_latents", "cache_text", "cache_empty_text")
STAGES = ("validate", "plan", "cache_latents", "cache_text", "cache_empty_text", "train", "export", "sample", "report")


@dataclass
class RunSummary:
    returncode: int
    jobs: list[str]  # jobs that ran in this invocation, e.g. "cache_text/s0001"
    stage_seconds: dict[str, float]
    wall_seconds: float
    interrupted_by: int | None = None  # SIGINT, SIGTERM or SIGHUP: every process of the run was stopped

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

    if problems := trackers.problems(cfg.train.trackers):  # before the cache jobs, not after them
        raise ConfigError("\n".join(problems))
    run_paths = RunPaths(workdir / cfg.output_dir)
    # Rules call `diffpipe ...`: make sure it is this installation's.
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    # The model first: a missing or incomplete one stops the run before its folder is claimed.
    if not dry_run and hub.prefetch(cfg.model):
        # A Hugging Face id is downloaded here, once; the jobs read that snapshot from the cache.
        env["HF_HUB_OFFLINE"] = "1"
    check_run_folder(run_paths.root)  # before Snakemake deletes old outputs there, and before the lock file
    # An interrupted job reruns whatever the profile says (Snakemake would refuse, naming --rerun-incomplete).
    extra = ["--rerun-incomplete", *extra]
    if regenerate:
        # The cache jobs read this and encode every entry again; Snakemake must rerun them.
        env["DIFFPIPE_REGENERATE"] = "1"
        extra += ["--forcerun", *REGENERATE_RULES]  # options, before the "--" that ends them
    cmd = snakemake_command(config, profile=Path(profile) if profile else None, cores=cores, dry_run=dry_run,
                            targets=list(targets), extra=extra, workdir=workdir)
    start = time.time()
    say = lambda m: console.print(m, markup=False, highlight=False, soft_wrap=True)  # noqa: E731
    live = show_live(console, dry_run=dry_run)
    with runproc.run_lock(run_paths.root, workdir, env, say=say, dry_run=dry_run) as fds, \
            LiveJobs(console, run_paths.root, since=start) if live else nullcontext() as view:
        finished = runproc.run_group(cmd, env=env, cwd=workdir, pass_fds=fds, say=say,
                                     output=view.print if view is not None else None)
    wall = time.time() - start
    jobs, seconds = _benchmarks(run_paths.benchmarks, since=start)
    summary = RunSummary(finished.returncode, jobs, seconds, wall, finished.signal)
    if not dry_run:
        _print_summary(console, summary, run_paths)
    return summary


def show_live(console: Console, *, dry_run: bool = False) -> bool:
    """Whether ``diffpipe run`` draws its live display: on a terminal, not for a dry run, not under --quiet.

    Elsewhere (a pipe, a file, a batch job) nothing is added: each job's log holds its plain progress lines.
    """
    return console.is_terminal and not dry_run and os.environ.get("DIFFPIPE_QUIET") != "1"


class LiveJobs:
    """While Snakemake runs: the running jobs' progress, read from their status files (:mod:`diffpipe.progress`),
    redrawn at the bottom of the terminal; Snakemake's own lines (:meth:`print`) go above it."""

    def __init__(self, console: Console, root: Path, *, since: float):
        self.root, self.since = root, since
        self.live = Live(console=console, get_renderable=self.render, refresh_per_second=2, transient=True,
                         redirect_stdout=False, redirect_stderr=False)

    def render(self) -> RenderableType:
        now = time.time()
        # Only this run's jobs: an earlier run's files stay until their jobs run again.
        jobs = [j for j in progress.read_jobs(self.root) if j.updated >= self.since and j.condition(now) == "running"]
        return render_jobs(jobs)

    def print(self, line: str) -> None:
        self.live.console.print(Text(line), soft_wrap=True)

    def __enter__(self) -> LiveJobs:
        self.live.start()
        return self

    def __exit__(self, *exc) -> None:
        self.live.stop()


def render_jobs(jobs: list[progress.JobState]) -> RenderableType:
    """One row per job: its name, a bar, and what it reported (step/total, loss, rate, ETA, ...)."""
    if not jobs:
        return Group()
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold cyan", no_wrap=True)
    grid.add_column(width=24)
    grid.add_column()
    for job in jobs:
        grid.add_row(job.label(), ProgressBar(total=max(job.total, 1), completed=job.done, width=24), job.describe())
    return grid


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
    if s.interrupted_by is not None:
        console.print(f"[bold red]interrupted[/] ({signal.Signals(s.interrupted_by).name}): no process of the run is "
                      "left and its locks are released; `diffpipe run` again continues (training resumes from its "
                      f"last checkpoint). Logs: {escape(str(p.root / 'logs'))}", soft_wrap=True)
        return
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
                 f"metrics, loss plot: {p.metrics}, {p.loss_plot}",
                 f"validation report:  {p.report_html}"):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    # Last: the one page that shows all of the above (diffpipe.report), when this run's DAG wrote it.
    if p.run_report.is_file():
        console.print(f"run report (open it in a browser): {p.run_report}", markup=False, highlight=False,
                      soft_wrap=True)
