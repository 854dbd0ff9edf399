"""``diffpipe run --dry-run --show-sbatch``: the ``sbatch`` call of every job, without submitting.

Snakemake's dry run prints each job's resolved resources (profile defaults,
``set-resources`` and the rule's own, evaluated). Each job's resources are fed
to the SLURM executor plugin's own command builders (``get_submit_command``
and ``set_gres_string``, the functions it calls before submitting), so what is
shown is what the plugin would run, minus the ``--wrap`` payload. Jobs after
the plan checkpoint (the cache shards) appear once the plan exists.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from diffpipe.runner import snakemake_command

_JOB_HEAD = re.compile(r"^(rule|checkpoint|localrule|localcheckpoint) (\w+):$")
_FIELD = re.compile(r"^\s+(\w+): (.*)$")
_RESOURCE_SPLIT = re.compile(r", (?=\w+=)")
_UNKNOWN = "<TBD>"


class _Resources(dict):
    """The job's resources as the plugin reads them: ``.get(name)`` and ``.name``."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError as err:
            raise AttributeError(name) from err


@dataclass
class PlannedJob:
    """One job of the dry run: its rule, wildcards, threads and resources."""

    rule: str
    local: bool = False
    wildcards: str = ""
    threads: int = 1
    resources: dict[str, Any] = field(default_factory=dict)
    shell: str = ""  # the job's command (the profile prints shell commands)


@dataclass
class Submission:
    rule: str
    wildcards: str
    command: str  # sbatch and its arguments (the job script is left out)
    shell: str  # what the job runs

    def args(self) -> dict[str, str]:
        """``--flag value`` / ``--flag=value`` / ``-x value`` pairs of the command, by flag."""
        out: dict[str, str] = {}
        tokens = shlex.split(self.command)[1:]
        i = 0
        while i < len(tokens):
            tok = tokens[i]
            if tok.startswith("--") and "=" in tok:
                key, _, value = tok.partition("=")
                out[key] = value
            elif tok.startswith("-") and i + 1 < len(tokens) and not tokens[i + 1].startswith("-"):
                out[tok] = tokens[i + 1]
                i += 1
            else:
                out[tok] = ""
            i += 1
        return out


def _value(text: str) -> Any:
    return int(text) if re.fullmatch(r"-?\d+", text) else text


def _complete(command: str) -> bool:
    """False while a quote in ``command`` is still open (it continues on the next line)."""
    try:
        shlex.split(command)
    except ValueError:
        return False
    return True


def parse_dry_run(text: str) -> list[PlannedJob]:
    """The jobs of Snakemake's dry-run output, with their resolved resources."""
    jobs: list[PlannedJob] = []
    open_shell = False  # a command whose quoted path holds a newline goes on on the next line
    for line in text.splitlines():
        if jobs and (open_shell or line.startswith("Shell command: ")):
            shell = jobs[-1].shell + "\n" + line if open_shell else line.removeprefix("Shell command: ")
            open_shell = not _complete(shell)
            jobs[-1].shell = shell if open_shell else shell.strip()
            continue
        head = _JOB_HEAD.match(line.strip())
        if head:
            jobs.append(PlannedJob(rule=head.group(2), local=head.group(1).startswith("local")))
            continue
        if not jobs or not (m := _FIELD.match(line)):
            continue
        key, value = m.groups()
        job = jobs[-1]
        if key == "wildcards":
            job.wildcards = value.strip()
        elif key == "threads":
            job.threads = int(value)
        elif key == "resources":
            for item in _RESOURCE_SPLIT.split(value.strip()):
                name, _, v = item.partition("=")
                if v != _UNKNOWN:
                    job.resources[name] = _value(v)
    return jobs


def submission(job: PlannedJob, workdir: Path) -> Submission:
    """The plugin's sbatch command for one job (account and partition from the resources)."""
    # deferred: the SLURM plugin imports Snakemake's executor API (~1 s); only a SLURM preview needs it
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command, safe_quote
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    res = _Resources(job.resources)
    like = SimpleNamespace(name=job.rule, threads=job.threads, resources=res, is_group=lambda: False)
    wildcards = job.wildcards.replace(", ", "_").replace("=", "~")
    params = {
        "run_uuid": "<run-uuid>",
        "slurm_logfile": Path(".snakemake/slurm_logs") / f"rule_{job.rule}" / wildcards / "%j.log",
        "comment_str": f"rule_{job.rule}" + (f"_wildcards_{wildcards}" if wildcards else ""),
        "account": f"-A {safe_quote(res['slurm_account'])}" if res.get("slurm_account") else "",
        "partition": f"-p {safe_quote(res['slurm_partition'])}" if res.get("slurm_partition") else "",
        "workdir": str(workdir),
    }
    command = get_submit_command(like, params) + set_gres_string(like)
    return Submission(job.rule, job.wildcards, re.sub(r" {2,}", " ", command), job.shell)


def dry_run_jobs(config: Path, profile: Path | None, workdir: Path, extra: list[str] = ()) -> list[PlannedJob]:
    """The jobs Snakemake would run now (its dry run), with their resolved resources and commands."""
    cmd = snakemake_command(config, profile=profile, cores=None if profile else 1, dry_run=True, targets=[],
                            extra=["--printshellcmds", *extra], workdir=workdir)
    result = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True)
    if result.returncode != 0:
        sys.stderr.write(result.stderr[-4000:])
        raise RuntimeError(f"snakemake dry run failed (exit {result.returncode}) with profile {profile}")
    return parse_dry_run(result.stdout + result.stderr)


def preview(config: Path, profile: Path, workdir: Path, extra: list[str] = ()) -> list[Submission]:
    """Dry-run the workflow with ``profile``; the sbatch command of every job that would be submitted."""
    jobs = dry_run_jobs(config, profile, workdir, extra)
    # A rule without a command (the target rule) is never submitted; the dry run
    # does not mark local rules, so it shows as "Shell command: None".
    return [submission(job, workdir) for job in jobs if not job.local and job.shell not in ("", "None")]
