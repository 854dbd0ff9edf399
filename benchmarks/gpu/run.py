"""The GPU kit: install the carried wheels, print the environment, run checks b-e, then a.

    python3 benchmarks/gpu/run.py                  # on the GPU machine (rows under $OUT)
    python3 benchmarks/gpu/run.py --dry-run --out /tmp/kit   # on CPU: same code path, tiny sizes

On the GPU machine it first installs ``.whl/*.whl`` (made by ``prepare.py``) with ``--no-deps`` into
``/tmp/site``, beside the machine's own torch, then runs the checks in a worker process (import path:
``/tmp/site``, then the repository). The checks run in this order, each writing its rows the moment a
point finishes: ``env`` (GPU, driver, torch, CUDA, packages, a bf16 matmul's rate), b (FLUX.1-dev steps per
option), c (bare loop), d (attention backends, compile), e (Qwen-Image, Wan 14B), then a (the demo workflow,
a dozen jobs that each import torch: over 200 s on an H200, so it takes what time is left).
A worker that dies (a crash, the OOM killer) is restarted on the checks not done yet; no point starts
after ``--budget`` seconds. At the end ``summary.md`` and a table on stdout. See README.md beside this file.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kit import ROOT, Run, read_rows  # noqa: E402

CHECKS = ["b", "c", "d", "e", "a"]  # the measurements first; the workflow takes what is left
ROW_LINE = re.compile(r"\[(env|a|b|c|d|e)\] ")  # what Run.row logs
SITE = Path("/tmp/site")


def install(wheels: Path, log) -> bool:
    """pip-install the carried wheels into SITE without dependencies (the machine has no network)."""
    files = sorted(str(p) for p in wheels.glob("*.whl"))
    if not files:
        log(f"install: no wheels in {wheels}: run `python benchmarks/gpu/prepare.py` here first and carry .whl")
        return False
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--upgrade", "--target", str(SITE), *files]
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log(f"install: {len(files)} wheels into {SITE} in {time.time() - start:.0f} s (rc {proc.returncode})")
    if proc.returncode:
        log(proc.stderr[-3000:])
    return proc.returncode == 0


def worker(run: Run, checks: list[str]) -> None:
    """Run ``checks`` in order in this process; a ``done`` row closes each."""
    import kit

    if "env" in checks:
        env = kit.environment(run.dry)
        run.row("env", "environment", "ok", **env)
        checks = [c for c in checks if c != "env"]
    matmul = next((r.get("matmul_bf16_tflops") for r in read_rows(run.out) if r["check"] == "env"), None)
    for check in checks:
        if run.left < 10:
            run.skip(check, "(whole check)", f"no time left ({run.left:.0f} s)")
        else:
            _one(run, check, matmul)
        run.row(check, "(check finished)", "done")


def _one(run: Run, check: str, matmul: float | None) -> None:
    if check == "a":
        from workflow_check import check_a

        check_a(run, run.out.parent / f"{run.out.name}-scratch" if run.dry else Path("/tmp/diffpipe-gpu-kit"))
    elif check == "b":
        from points import check_b

        check_b(run, matmul)
    elif check == "c":
        from bare import check_c

        row = next((r for r in read_rows(run.out) if r["check"] == "b" and r["point"] == "flux bf16+ckpt"), None)
        check_c(run, row)
    elif check == "d":
        from points import check_d

        check_d(run, matmul)
    elif check == "e":
        from points import check_e

        check_e(run, matmul)


def orchestrate(args, run: Run) -> int:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
    if not run.dry:
        if not install(ROOT / ".whl", run.log):
            run.row("env", "install", "error", error="the carried wheels did not install (see log.txt)")
            return 1
        paths.insert(0, str(SITE))
    else:
        run.log("install: skipped (dry run: the wheels are for the GPU machine's Python 3.12)")
    env["PYTHONPATH"] = os.pathsep.join(paths)
    todo = ["env", *[c for c in CHECKS if not run.only or c in run.only]]
    while todo and run.left > 10:
        cmd = [sys.executable, __file__, "--worker", "--out", str(run.out), "--deadline", str(run.deadline),
               "--checks", ",".join(todo), "--steps", str(run.steps), "--warmup", str(run.warmup)]
        if run.dry:
            cmd.append("--dry-run")
        # A point in flight at the deadline may finish within a minute; then the worker and its
        # children (Snakemake's jobs) are killed.
        rc = _watch(cmd, env, run.left + 60, run.out / "worker.txt")
        done = {r["check"] for r in read_rows(run.out) if r["status"] == "done" or r["check"] == "env"}
        left = [c for c in todo if c not in done]
        if rc == 0 or not left:
            todo = left
            break
        run.row(left[0], "(worker)", "error", error=f"the worker stopped ({rc}) during check {left[0]}; "
                "see worker.txt")
        todo = left[1:]  # the check that killed the worker is not retried
    for check in todo:
        run.skip(check, "(whole check)", f"no time left ({run.left:.0f} s)")
    summary(run)
    return 0


def _watch(cmd: list[str], env: dict[str, str], timeout: float, log: Path) -> int | str:
    """Run the worker in its own process group: all its output to ``log``, its row lines (``[check] ...``)
    echoed here as they come (the device tool returns the end of this output even after a kill)."""
    import signal
    import threading

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)

    def pump() -> None:
        with open(log, "a") as f:
            for line in proc.stdout:
                f.write(line)
                if ROW_LINE.match(line):
                    print(line, end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc: int | str = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = "timeout"
    reader.join(timeout=10)
    return rc


def summary(run: Run) -> None:
    """summary.md: one line per row (check, point, status, the main figures), printed too."""
    keys = ["s_per_step", "peak_bytes", "estimate_bytes", "estimate_over_measured", "tflops_per_device", "mfu",
            "mfu_vs_measured_matmul", "speedup_vs_native", "compile_s", "diffpipe_over_bare", "swap_over_no_swap",
            "rc", "steps", "cuda_peak_mb", "copier", "max_rel_diff", "reason", "error"]
    lines = ["| check | point | status | figures |", "| --- | --- | --- | --- |"]
    for r in read_rows(run.out):
        if r["status"] == "done":
            continue
        figs = ", ".join(f"{k}={_fmt(r[k])}" for k in keys if r.get(k) not in (None, ""))
        if r["check"] == "env":
            figs = ", ".join(f"{k}={r.get(k)}" for k in ("gpu", "nvidia_smi", "torch", "cuda", "matmul_bf16_tflops")
                             if k in r)
            figs += "; " + " ".join(f"{k}={v}" for k, v in (r.get("packages") or {}).items() if v)
        lines.append(f"| {r['check']} | {r['point']} | {r['status']} | {figs.replace('|', '/')} |")
    text = "\n".join(lines) + "\n"
    (run.out / "summary.md").write_text(text)
    print(text, flush=True)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int) and v > 2**20:
        return f"{v / 2**30:.2f}GiB"
    s = str(v).replace("\n", " ")
    return s if len(s) <= 160 else s[:157] + "..."


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU: the same code path at tiny width and depth")
    ap.add_argument("--out", type=Path, default=None, help="where rows go (default: $OUT, else ./gpu-kit-out)")
    ap.add_argument("--budget", type=float, default=None, help="seconds after which no point starts "
                    "(default 450 on the GPU, 300 dry)")
    ap.add_argument("--checks", default="", help="a subset of b,c,d,e,a (default: all, in that order)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per point (default 5; dry run 2)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps per point (default 2; dry run 1)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = args.out or Path(os.environ.get("OUT") or "gpu-kit-out")
    steps = args.steps or (2 if args.dry_run else 5)
    warmup = args.warmup or (1 if args.dry_run else 2)
    if args.worker:
        run = Run(out, args.dry_run, args.deadline, steps, warmup)
        worker(run, args.checks.split(","))
        return 0
    budget = args.budget or (300.0 if args.dry_run else 450.0)
    only = {c for c in args.checks.split(",") if c}
    if only - set(CHECKS):
        ap.error(f"--checks: unknown {sorted(only - set(CHECKS))}; choose from {','.join(CHECKS)}")
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out, args.dry_run, time.time() + budget, steps, warmup, only)
    run.log(f"gpu kit: {'dry run' if run.dry else 'GPU run'}, budget {budget:.0f} s, out {out}")
    return orchestrate(args, run)


if __name__ == "__main__":
    sys.exit(main())
