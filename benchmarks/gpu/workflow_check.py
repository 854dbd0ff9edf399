"""Check a: ``diffpipe run`` of the demo config, end to end (validate, cache, train, export, sample), in bf16.

The demo config (``config/demo.yaml``) with ``train.precision: bf16`` and its output under the kit's scratch
folder runs through the real front end: ``python3 -m diffpipe run``, which runs Snakemake, whose rules call
``diffpipe <stage>``; a ``diffpipe`` launcher (``python3 -m diffpipe``) goes first on PATH, since the
repository is not pip-installed on the GPU machine. On CUDA every stage runs on the GPU: the row reports the
jobs' exit code, the training metrics (peak CUDA memory, loss, s/step) and the exported and sampled files.

Dry run: the same config and launcher through ``diffpipe run --dry-run`` (Snakemake plans every job and
runs none): a real run of the workflow on CPU costs minutes and is covered by tests/workflow.
Polars: validate and plan hold their tables in polars, and its runtime wheel (51 MiB) does not fit beside the
kit's other wheels in what travels (64 MiB); on a machine without it the check is reported skipped with that
reason rather than failing inside the validate job. Running it there needs polars installed on that machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from kit import ROOT, Run, run_group

TIMEOUT_S = 240


def write_config(scratch: Path) -> Path:
    """The demo config, bf16, its data and model by absolute path and its output in ``scratch``."""
    cfg = yaml.safe_load((ROOT / "config" / "demo.yaml").read_text())
    cfg["output_dir"] = str(scratch / "demo-run")
    for ds in cfg["datasets"]:
        ds["path"] = str((ROOT / ds["path"]).resolve())
    if cfg["model"].get("path"):  # the shipped demo model, config/demo_model
        cfg["model"]["path"] = str((ROOT / cfg["model"]["path"]).resolve())
    cfg.setdefault("train", {})["precision"] = "bf16"
    scratch.mkdir(parents=True, exist_ok=True)
    path = scratch / "demo-bf16.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def launcher(scratch: Path) -> Path:
    """A folder holding ``diffpipe``: this Python running ``-m diffpipe`` (the rules' command)."""
    bin_dir = scratch / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    exe = bin_dir / "diffpipe"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m diffpipe "$@"\n')
    exe.chmod(0o755)
    return bin_dir


def check_a(run: Run, scratch: Path) -> None:
    if importlib.util.find_spec("polars") is None:
        run.skip("a", "demo workflow bf16", "polars is not installed here: validate and plan need it, and its "
                 "51 MiB runtime wheel does not fit in what the kit carries")
        return
    marker = scratch / ".diffpipe-gpu-kit"
    if marker.is_file():  # a rerun on a warm machine: the workflow must run again, not find its outputs
        shutil.rmtree(scratch / "demo-run", ignore_errors=True)
    elif scratch.exists() and any(scratch.iterdir()):
        run.row("a", "demo workflow bf16", "error", error=f"{scratch} exists and was not made by the kit")
        return
    scratch.mkdir(parents=True, exist_ok=True)
    marker.touch()
    config, bin_dir = write_config(scratch), launcher(scratch)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    cmd = [sys.executable, "-m", "diffpipe", "run", "--config", str(config), "--workdir", str(scratch)]
    if run.dry:
        cmd.append("--dry-run")
    # A normal run takes 1-2 minutes on the GPU; past TIMEOUT_S the later checks matter more.
    timeout = max(30.0, min(run.left, TIMEOUT_S))
    start = time.time()
    rc, stdout, stderr = run_group(cmd, timeout=timeout, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE)
    wall = time.time() - start
    with open(run.out / "log.txt", "a") as log:
        log.write(f"--- check a: {' '.join(cmd)}\n{stdout[-6000:]}{stderr[-6000:]}\n")
    fields: dict[str, Any] = {"rc": rc, "wall_s": round(wall, 1)}
    if run.dry:
        fields["jobs_planned"] = stdout.count("rule ") + stderr.count("rule ")
        run.row("a", "demo workflow bf16 (snakemake dry run)", "dry-run" if rc == 0 else "error",
                **fields, **({} if rc == 0 else {"error": stderr[-2000:]}))
        return
    fields.update(outputs(scratch / "demo-run"))
    ok = rc == 0 and fields.get("cuda_peak_mb", 0) > 0 and fields["exports"] and fields["samples"]
    if not ok:
        logs = failed_job_logs(stdout + stderr)
        with open(run.out / "log.txt", "a") as log:
            log.writelines(f"--- failed job's log {path}\n{tail}\n" for path, tail in logs.items())
        fields.update(error=(stderr or stdout)[-1500:], job_logs={p: t[-2500:] for p, t in logs.items()})
    run.row("a", "demo workflow bf16", "ok" if ok else "error", **fields)


def failed_job_logs(text: str, lines: int = 60) -> dict[str, str]:
    """The last ``lines`` lines of each log Snakemake names for a failed job (``log: PATH (check log ...``):
    the job's own traceback, which Snakemake's output leaves out."""
    found = {}
    for path in dict.fromkeys(re.findall(r"log: (\S+) \(check log file", text)):
        try:
            found[path] = "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
        except OSError as err:
            found[path] = f"(unreadable: {err})"
    return found


def outputs(root: Path) -> dict[str, Any]:
    """What the run left: training metrics (CUDA peak, losses, s/step), exported files, sample images."""
    from diffpipe.paths import RunPaths

    paths = RunPaths(root)
    out: dict[str, Any] = {"exports": sorted(p.name for p in paths.export_dir.glob("*")) if paths.export_dir.is_dir()
                           else [],
                           "samples": len(list(paths.samples_dir.rglob("*.png"))) if paths.samples_dir.is_dir() else 0}
    if paths.metrics.is_file():
        rows = [json.loads(line) for line in paths.metrics.read_text().splitlines() if line.strip()]
        steps = [r for r in rows if "step_time" in r]
        if steps:
            times = sorted(r["step_time"] for r in steps[1:]) or [steps[0]["step_time"]]
            out.update(steps=len(steps), first_loss=steps[0]["loss"], last_loss=steps[-1]["loss"],
                       s_per_step=times[len(times) // 2], cuda_peak_mb=max(r["peak_memory_mb"] for r in steps))
    return out
