"""Time and peak RSS of a memory plan (``diffpipe plan-memory``) and of the docs' memory-fits table, with the
estimates sharing their meta denoisers and traced forwards (:class:`diffpipe.meta_denoiser.Reuse`) against
each estimate built alone, and optionally against another git revision's code; the ratios in the same run.

Usage (figures in docs/benchmarks.md, "Memory plan"):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_memory_reuse.py [--model flux1-dev] [--gpu-memory 12]
        [--fits FLUX.1-dev Qwen-Image] [--rev REV]

Each case runs in a fresh process (``OMP_NUM_THREADS=1``) that reports its wall and CPU time (CPU time is
the figure to compare on a shared machine), its RSS after the imports and its peak RSS (``VmHWM``):

- ``plan``: :func:`diffpipe.memory_plan.plan_memory` for ``--model`` at ``--gpu-memory`` GiB, as
  ``diffpipe plan-memory`` makes it (the flux config of ``config/`` shape: rank 16, batch 1, 1024 px);
- ``plan, each estimate alone``: the same plan with an estimator that builds and traces every candidate on
  its own (what the planner did before it shared them);
- ``fits``: :func:`diffpipe.fits.fits_markdown` restricted to the ``--fits`` rows (their labels in
  ``diffpipe.fits.FITS_MODELS``), as ``python -m diffpipe.readme_tables`` builds the table;
- with ``--rev REV``: ``plan`` and ``fits`` again with the ``diffpipe`` package of that git revision
  (``git archive``), e.g. the commit before the sharing; their plans and tables must equal this tree's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_peak import _status  # noqa: E402  (the same /proc/self/status reader)

REPO = Path(__file__).resolve().parents[1]
GiB = 1024**3


def _flux_config(family: str):
    from diffpipe.config import Config

    return Config.model_validate(
        {"model": {"family": family}, "datasets": [{"name": "d", "path": "data", "resolution": 1024}],
         "train": {"batch_size": 1, "precision": "bf16", "lora": {"rank": 16}}})


def child(case: str, model: str, gib: float, rows: list[str]) -> dict:
    """Run one case in this process; its result, seconds and RSS figures."""
    from diffpipe import fits
    from diffpipe import memory_plan as mp
    from diffpipe.estimate import estimate_memory
    from diffpipe.families.published import PUBLISHED

    base = _status("VmRSS")
    start, cpu = time.perf_counter(), time.process_time()
    if case == "fits":
        fits.FITS_MODELS = tuple(e for e in fits.FITS_MODELS if e[0] in rows)
        result = fits.fits_markdown()
    else:
        cfg = _flux_config(PUBLISHED[model].family)
        alone = (lambda c: estimate_memory(c, model=model)) if case == "plan-alone" else None
        plan = mp.plan_memory(cfg, int(gib * GiB), model=model, estimate=alone)
        result = "\n".join(plan.lines())
    return {"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu, "base": base,
            "peak": _status("VmHWM"), "result": result}


def _run(case: str, args: argparse.Namespace, path: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(path), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--child", case, "--model", args.model, "--gpu-memory", str(args.gpu_memory),
           "--fits", *args.fits]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{case} at {path} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _revision(rev: str, into: Path) -> Path:
    """The diffpipe package of ``rev``, extracted under ``into``."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "diffpipe"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def _line(name: str, r: dict, ref: dict | None = None) -> str:
    """One case: wall and CPU seconds, peak RSS and its growth over the imports; against ``ref``, the ratios."""
    grown = r["peak"] - r["base"]
    ratio = (f"  (CPU time / {ref['cpu'] / r['cpu']:.1f}, growth / {(ref['peak'] - ref['base']) / max(grown, 1):.1f})"
             if ref else "")
    return (f"{name:30s} {r['seconds']:6.1f} s wall {r['cpu']:6.1f} s CPU   peak RSS {r['peak'] / GiB:5.2f} GiB "
            f"(+{grown / GiB:4.2f} over the imports){ratio}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="flux1-dev")
    p.add_argument("--gpu-memory", type=float, default=12.0)
    p.add_argument("--fits", nargs="*", default=["FLUX.1-dev", "Qwen-Image"])
    p.add_argument("--rev", help="also run plan and fits with this git revision's diffpipe package")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model, args.gpu_memory, args.fits)))
        return
    plan, alone, table = (_run(c, args, REPO) for c in ("plan", "plan-alone", "fits"))
    print(f"{args.model} at {args.gpu_memory:g} GiB; fits rows: {', '.join(args.fits)}")
    print(_line("plan (shared)", plan, alone))
    print(_line("plan, each estimate alone", alone))
    print(_line("fits (shared)", table))
    assert plan["result"] == alone["result"], "the shared plan differs from the plan of lone estimates"
    if args.rev:
        with tempfile.TemporaryDirectory() as tmp:
            old = _revision(args.rev, Path(tmp))
            old_plan, old_table = (_run(c, args, old) for c in ("plan", "fits"))
        print(_line(f"plan at {args.rev}", old_plan))
        print(_line(f"fits at {args.rev}", old_table))
        print(_line("plan (shared) against it", plan, old_plan))
        print(_line("fits (shared) against it", table, old_table))
        assert plan["result"] == old_plan["result"], f"the plan differs from {args.rev}'s"
        assert table["result"] == old_table["result"], f"the fits table differs from {args.rev}'s"
    print("plan:\n" + plan["result"])


if __name__ == "__main__":
    main()
