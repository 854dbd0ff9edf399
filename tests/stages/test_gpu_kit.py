"""The GPU kit (benchmarks/gpu/) cannot rot between GPU lendings: its dry run runs here, on CPU, through the
same functions and row writing as on the GPU, at tiny width and depth, and every check leaves its rows."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / "benchmarks" / "gpu"
OPTIONS = ["bf16+ckpt", "fp8+ckpt", "int8+ckpt", "nf4+ckpt", "fp8+ckpt+swap_half"]


def test_the_dry_run_runs_every_check_and_writes_its_rows(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, str(KIT / "run.py"), "--dry-run", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:] + (out / "worker.txt").read_text()[-3000:]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert not [r for r in rows if r["status"] in ("error", "oom")], (out / "worker.txt").read_text()[-3000:]
    by = {(r["check"], r["point"]): r for r in rows}
    env_row = by["env", "environment"]
    assert env_row["torch"] and env_row["matmul_bf16_tflops"] > 0 and "diffusers" in env_row["packages"]
    # Each check ran to its end: the measurements first, the workflow last.
    assert [r["check"] for r in rows if r["status"] == "done"] == ["b", "c", "d", "e", "a"]
    assert by["a", "demo workflow bf16 (snakemake dry run)"]["status"] == "dry-run"
    assert by["a", "demo workflow bf16 (snakemake dry run)"]["jobs_planned"] > 0
    for option in OPTIONS:  # the real code path measured something: a step time, FLOPs and an estimate
        r = by["b", f"flux {option}"]
        assert r["status"] == "dry-run" and r["s_per_step"] > 0 and r["flops_per_step"] > 0
        assert r["estimate_bytes"] > 0 and len(r["step_times"]) == 2
    same = by["b", "block swap prefetch: same step as no swap (tiny flux, every block)"]
    assert same["status"] == "ok" and same["max_rel_diff"] == 0 and same["copier"] == "SyncCopier"
    # 5 blocks, each loaded in the forward and in its recomputation; every load but the very first (no block
    # runs before it to start its copy) found its copy under way.
    assert same["onloads"] == 10 and same["prefetched"] == 9
    swap = by["b", "flux fp8+ckpt+swap_half"]
    assert swap["swapped_blocks"] == 2 and swap["prefetched"] == swap["onloads"] > 0
    assert by["b", "block swap slowdown"]["swap_over_no_swap"] > 0
    assert by["c", "flux bf16+ckpt bare diffusers+peft loop"]["diffpipe_over_bare"] > 0
    assert by["d", "flux bf16+ckpt attention _native_math"]["speedup_vs_native"] > 0
    # GPU-only pieces are skipped by name, with the reason, never given a figure.
    assert by["b", "block swap side-stream copies (StreamCopier)"]["status"] == "skipped"
    for name in ("_native_flash", "_native_cudnn", "flash", "compile"):
        point = f"flux bf16+ckpt {'attention ' if name != 'compile' else ''}{name}"
        assert by["d", point]["status"] == "skipped" and by["d", point]["reason"]
    assert by["e", "qwenimage nf4+ckpt"]["status"] == by["e", "wan fp8+ckpt+swap_half"]["status"] == "dry-run"
    summary = (out / "summary.md").read_text()
    assert summary.count("\n") == len([r for r in rows if r["status"] != "done"]) + 2


def _pins(text: str) -> dict[str, str]:
    pins = {}
    for line in text.splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split()[0].split("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def test_the_carried_wheels_pin_the_versions_the_suite_passes_with():
    carried, tested = _pins((KIT / "wheels.txt").read_text()), _pins((ROOT / "constraints.txt").read_text())
    assert {"diffusers", "deepspeed", "torchao", "zarr", "snakemake", "pydantic"} <= carried.keys()
    assert {k: v for k, v in carried.items() if k in tested} == {k: tested[k] for k in carried if k in tested}
    # polars' wheel (54 MB) does not fit beside the rest. Importing the kit's entry points must not load it;
    # validate and plan load it when they run (their tables: columnar.py, plan_table.py), as do validation
    # shards (vshards.py, tshards.py, their probe_table.py), so a kit run of those stages needs polars on the machine or their outputs carried.
    assert "polars" not in carried
    probe = ("import sys, diffpipe.cli, diffpipe.stages, diffpipe.training.loop, diffpipe.data.dataset.validate, "
             "diffpipe.data.cache.plan, diffpipe.export.api; print('polars' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]
    importers = {p.name for p in (ROOT / "diffpipe").rglob("*.py")
                 if re.search(r"^(import|from) polars", p.read_text(), re.M)}  # at module level
    assert importers <= {"vshards.py", "tshards.py", "probe_table.py", "columnar.py", "plan_table.py"}, importers


def test_a_run_out_of_time_still_leaves_a_row_for_every_check(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(KIT / "run.py"), "--dry-run", "--out", str(out), "--budget", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["check"], r["status"]) for r in rows] == [(c, "skipped") for c in ("env", *"bcdea")]
    assert all("no time left" in r["reason"] for r in rows) and "| a | (whole check) | skipped |" in proc.stdout


def test_a_failed_workflow_row_carries_the_failed_jobs_own_log(tmp_path):
    """On the GPU, check a's first failure came back as Snakemake's summary alone; the job's traceback is
    in the log Snakemake names, which the row now carries."""
    sys.path.insert(0, str(KIT))
    try:
        from workflow_check import failed_job_logs
    finally:
        sys.path.remove(str(KIT))
    log = tmp_path / "logs" / "train.log"
    log.parent.mkdir()
    log.write_text("".join(f"line {i}\n" for i in range(100)) + "RuntimeError: the real cause\n")
    snakemake = f"Error in rule train:\n    log: {log} (check log file(s) for error details)\n" * 2
    logs = failed_job_logs(snakemake + f"    log: {tmp_path / 'gone.log'} (check log file(s) for error details)")
    assert list(logs) == [str(log), str(tmp_path / "gone.log")]
    assert logs[str(log)].endswith("RuntimeError: the real cause") and "line 41\n" in logs[str(log)]
    assert "line 40\n" not in logs[str(log)] and logs[str(tmp_path / "gone.log")].startswith("(unreadable")
