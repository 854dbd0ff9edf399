"""The workflow through profiles/slurm on a real SLURM cluster (slurmctld + slurmd here).

Jobs are submitted with sbatch by the real executor plugin, run, and produce
the same outputs as a local run of the same config.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

from diffpipe.cli import app
from diffpipe.data.dataset.demo import write_demo_dataset
from diffpipe.paths import REPO_ROOT, RunPaths
from diffpipe.runner import run_workflow
from diffpipe.training.metrics import read_metrics

from .slurm_cluster import LocalSlurm, SlurmUnavailable

pytestmark = pytest.mark.slow
RULES = ("validate", "plan", "cache_latents", "cache_text", "train", "export", "sample")


@pytest.fixture(scope="module")
def slurm():
    # Its own folder, not pytest's tmp_path: daemons must outlive any pytest cleanup.
    cluster = LocalSlurm(Path(tempfile.mkdtemp(prefix="diffpipe-slurm-")))
    try:
        cluster.start()
    except SlurmUnavailable as err:
        pytest.skip(str(err))
    yield cluster
    cluster.stop()
    shutil.rmtree(cluster.root, ignore_errors=True)


def cluster_profile(dest: Path, partition: str) -> Path:
    """profiles/slurm with its placeholders filled for this one-node CPU cluster."""
    cfg = yaml.safe_load((REPO_ROOT / "profiles" / "slurm" / "config.yaml").read_text())
    res = cfg["default-resources"]
    res["slurm_partition"] = partition
    del res["slurm_account"]  # no accounting database here
    res.update(mem_mb=1500, cpus_per_task=1)
    for rule in cfg["set-resources"].values():  # no GPUs and 2 cores on this node
        rule.update(gpu=0, cpus_per_task=1, mem_mb=1500)
    # Training as the profile's multi-node recipe, on this one node: 2 srun
    # tasks, each one rank (the rendezvous comes from SLURM).
    cfg["set-resources"]["train"].update(tasks=2, mpi="srun --ntasks 2 --cpus-per-task 1 --kill-on-bad-exit=1")
    cfg.update({
        "slurm-status-command": "squeue",  # accounting (sacct) is disabled here
        "slurm-init-seconds-before-status-checks": 1,
        "seconds-between-status-checks": 1,
        "slurm-keep-successful-logs": True,  # the proof below that each rule went through sbatch
        "latency-wait": 5,
    })
    dest.mkdir(parents=True)
    (dest / "config.yaml").write_text(yaml.safe_dump(cfg))
    return dest


def start_local_reference(config: Path, workdir: Path) -> subprocess.Popen:
    """The same stages run locally through the CLI (the commands the rules run): the data stages in this
    process, then training on 2 processes (our launcher, like the 2 srun ranks), started here and left
    running while the cluster runs (``finish_local_reference`` waits for it and exports). Cheaper than a
    second Snakemake run; the workflow itself is what the cluster run and the demo workflow test check."""
    runner, c = CliRunner(), str(config)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.chdir(workdir)  # the config's output_dir is relative, as in the rules
        for args in (["validate"], ["plan"], ["cache", "empty"]):
            result = runner.invoke(app, [*args, "-c", c])
            assert result.exit_code == 0, (args, result.output)
        for shard in RunPaths(workdir / "run").shard_names("latents"):
            for kind in ("latents", "text"):
                result = runner.invoke(app, ["cache", kind, "-c", c, "--shard", shard])
                assert result.exit_code == 0, (kind, result.output)
    with open(workdir / "train.log", "w") as log:  # a file, not a pipe: a full pipe would stall the ranks
        return subprocess.Popen([sys.executable, "-m", "diffpipe", "train", "-c", c, "--processes", "2"],
                                cwd=workdir, stdout=log, stderr=subprocess.STDOUT)


def finish_local_reference(train: subprocess.Popen, config: Path, workdir: Path) -> None:
    assert train.wait(timeout=1500) == 0, (workdir / "train.log").read_text()[-3000:]
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.chdir(workdir)
        result = CliRunner().invoke(app, ["export", "-c", str(config)])
        assert result.exit_code == 0, result.output


def small_demo_config(root: Path) -> Path:
    """The demo config on 8 demo images at 32 px, 2 training steps of batch 2 per rank (so each of the
    2 ranks trains on its own items) and a 1-step sample of one prompt: every rule still runs, as one
    job each (one cache shard), and each job costs little more than its interpreter start-up."""
    write_demo_dataset(root / "data", n=8, size=32)
    cfg = yaml.safe_load((REPO_ROOT / "config" / "demo.yaml").read_text())
    cfg.update(output_dir="run")
    cfg["datasets"][0].update(path=str(root / "data"), resolution=32)
    cfg["model"]["path"] = str(REPO_ROOT / cfg["model"]["path"])  # the job runs in root
    cfg["train"].update(max_steps=2, batch_size=2)
    cfg["cache"] = {"shards": 1}  # fewer jobs: each costs an interpreter start-up
    cfg["sample"].update(steps=1, prompts=cfg["sample"]["prompts"][:1])
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return config


def test_workflow_on_slurm_matches_local_run(slurm, tmp_path):
    config = small_demo_config(tmp_path)
    (tmp_path / "local").mkdir()
    (tmp_path / "cluster").mkdir()

    local_train = start_local_reference(config, tmp_path / "local")
    try:
        profile = cluster_profile(tmp_path / "profile", partition="debug")
        remote = run_workflow(config, profile=profile, workdir=tmp_path / "cluster")
    except BaseException:
        local_train.wait(timeout=1500)  # no ranks left running after the test; the cluster's error is raised
        raise
    finish_local_reference(local_train, config, tmp_path / "local")
    assert remote.returncode == 0

    logs = tmp_path / "cluster" / ".snakemake" / "slurm_logs"
    submitted = {p.name.removeprefix("rule_") for p in logs.iterdir()}
    assert set(RULES) <= submitted, f"not submitted through sbatch: {set(RULES) - submitted}"

    a, b = RunPaths(tmp_path / "local" / "run"), RunPaths(tmp_path / "cluster" / "run")
    for kind in ("latents", "text"):
        for shard in a.shard_names(kind):
            spec_a = (a.plan_dir / kind / f"{shard}.json").read_bytes()
            assert spec_a == (b.plan_dir / kind / f"{shard}.json").read_bytes()
    for run in (a, b):
        summary = json.loads((run.train_dir / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["ranks_agree"] is True
    la = [r["loss"] for r in read_metrics(a.metrics)]
    lb = [r["loss"] for r in read_metrics(b.metrics)]
    assert la == pytest.approx(lb, abs=1e-6)
    wa, wb = load_file(str(a.export_diffusers)), load_file(str(b.export_diffusers))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6)
