"""The sbatch call of every rule through profiles/slurm, for 2 nodes x 4 GPUs, without submitting.

The profile's documented multi-node recipe (commented lines under ``train``)
is uncommented exactly as a user would; the commands come from the SLURM
executor plugin's own builders fed with the resources of Snakemake's dry run.
"""

from __future__ import annotations

import shutil

import pytest
import yaml
from typer.testing import CliRunner

from diffpipe.cli import app
from diffpipe.paths import REPO_ROOT
from diffpipe.runner import run_workflow
from diffpipe.sbatch import parse_dry_run, preview

PROFILE = REPO_ROOT / "profiles" / "slurm" / "config.yaml"


def multinode_profile(dest):
    """profiles/slurm with the train rule's multi-node lines uncommented."""
    lines, out, in_recipe = PROFILE.read_text().splitlines(), [], False
    for line in lines:
        if "Several nodes instead" in line:
            in_recipe = True
        elif (
            in_recipe
            and line.startswith("    # ")
            and ":" in line
            and not line.strip("# ").startswith(("Each", "Preview"))
        ):
            line = "    " + line.removeprefix("    # ")
        elif in_recipe and not line.startswith("    #"):
            in_recipe = False
        out.append(line)
    cfg = yaml.safe_load("\n".join(out))
    dest.mkdir()
    (dest / "config.yaml").write_text(yaml.safe_dump(cfg))
    return dest, cfg


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """The demo config validated and planned (the cache shards are known after the plan)."""
    root = tmp_path_factory.mktemp("sbatch")
    shutil.copytree(REPO_ROOT / "config" / "demo_data", root / "data")
    cfg = yaml.safe_load((REPO_ROOT / "config" / "demo.yaml").read_text())
    cfg.update(output_dir=str(root / "run"))
    cfg["datasets"][0]["path"] = str(root / "data")
    cfg["model"]["path"] = str(REPO_ROOT / cfg["model"]["path"])  # relative paths start at the workdir
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    assert run_workflow(config, cores=1, targets=["plan"], workdir=root).returncode == 0
    return root, config


def test_two_nodes_four_gpus_sbatch_arguments(planned, tmp_path):
    root, config = planned
    profile, cfg = multinode_profile(tmp_path / "profile")
    assert cfg["set-resources"]["train"]["nodes"] == 2, "the recipe was not found in profiles/slurm"
    jobs = preview(config, profile, root)
    for job in jobs:
        print(f"{job.rule} {job.wildcards}\n  {job.command}\n  runs: {job.shell}")
    by_rule = {}
    for job in jobs:
        by_rule.setdefault(job.rule, []).append(job)
    assert "all" not in by_rule, "the target rule must stay local"
    assert {"cache_latents", "cache_text", "cache_empty_text", "train", "export", "sample"} <= set(by_rule)
    assert len(by_rule["cache_latents"]) == len(by_rule["cache_text"]) == 2  # the demo's 2 shards

    (train,) = by_rule["train"]
    args = train.args()
    assert args["--nodes"] == "2" and args["--ntasks-per-node"] == "4" and args["--gres"] == "gpu:4"
    assert "--gpus" not in args and "--ntasks-per-gpu" not in args, train.command
    assert args["--cpus-per-task"] == "8" and args["--mem"] == "256000" and args["-t"] == "2880"
    assert args["-p"] == "<partition>" and args["-A"] == "<account>"
    assert train.shell.startswith("srun --kill-on-bad-exit=1 diffpipe train"), train.shell

    for job in by_rule["cache_latents"] + by_rule["cache_text"]:  # many small single-GPU jobs
        a = job.args()
        assert a["--gpus"] == "1" and "--nodes" not in a and a["--mem"] == "32000", job.command
        assert job.wildcards.startswith("shard=")
    assert "validate" not in by_rule and "plan" not in by_rule, "done already: not planned again"
    export = by_rule["export"][0].args()
    assert "--gpus" not in export and export["--ntasks"] == "1"
    assert by_rule["sample"][0].args()["--gpus"] == "1"


def test_single_node_train_is_one_task_with_four_gpus(planned):
    root, config = planned
    (train,) = [j for j in preview(config, PROFILE.parent, root) if j.rule == "train"]
    args = train.args()
    assert args["--gpus"] == "4" and "--nodes" not in args and "--ntasks-per-node" not in args
    assert "--processes 4" in train.shell and not train.shell.startswith("srun")


def test_validate_is_a_cpu_job_and_cli_prints_commands(tmp_path):
    """Before anything ran: validate and plan are planned, validate with 16 CPUs and no GPU."""
    shutil.copytree(REPO_ROOT / "config" / "demo_data", tmp_path / "data")
    cfg = yaml.safe_load((REPO_ROOT / "config" / "demo.yaml").read_text())
    cfg.update(output_dir=str(tmp_path / "run"))
    cfg["datasets"][0]["path"] = str(tmp_path / "data")
    cfg["model"]["path"] = str(REPO_ROOT / cfg["model"]["path"])  # relative paths start at the workdir
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(
        app,
        [
            "run",
            "-c",
            str(config),
            "--profile",
            str(PROFILE.parent),
            "--show-sbatch",
            "--workdir",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output
    validate = result.output[result.output.index("validate") : result.output.index("plan")]
    assert "--cpus-per-task=16" in validate and "--gpus" not in validate and "-t 240" in validate
    assert not (tmp_path / "run" / "validate" / "manifest.parquet").exists(), "a preview runs nothing"


def test_parse_dry_run_reads_resources_with_spaces_and_unknowns():
    text = """
[Sat Nov 21 13:29:41 2026]
rule train:
    input: <TBD>
    jobid: 3
    threads: 2
    resources: tmpdir=/tmp, mem_mb=256000, disk_mb=<TBD>, gpu=4, mpi=srun --kill-on-bad-exit=1, runtime=2880
Shell command: srun --kill-on-bad-exit=1 diffpipe train --config c.yaml --processes 4

[Sat Nov 21 13:29:41 2026]
localrule all:
    input: a
"""
    train, everything = parse_dry_run(text)
    assert train.rule == "train" and not train.local and train.threads == 2
    assert train.resources == {
        "tmpdir": "/tmp",
        "mem_mb": 256000,
        "gpu": 4,
        "mpi": "srun --kill-on-bad-exit=1",
        "runtime": 2880,
    }
    assert train.shell.endswith("--processes 4")
    assert everything.rule == "all" and everything.local
