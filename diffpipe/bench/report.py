"""The lines ``diffpipe bench`` prints for a finished sweep or convergence comparison."""

from __future__ import annotations

from diffpipe.bench.sweep import BenchResult


def convergence_lines(result: BenchResult) -> list[str]:
    """One line per precision or optimizer (its final loss against the reference's), then where the files are."""
    lines = []
    for r in result.rows:
        diff = r["final_loss_diff"]
        lines.append(f"convergence: {r['name']:5s} {r['status']:7s} final loss "
                     + (f"{r['final_loss']:.5f} ({diff:+.5f} vs {result.extra['reference']})" if diff != "" else "-")
                     + (f"  {r['error']}" if r["error"] else ""))
    return [*lines, f"convergence: wrote {result.csv} and {result.plot}"]


def sweep_lines(result: BenchResult) -> list[str]:
    """One line per grid point (speed and memory, or why it did not train), then where the files are."""
    lines = []
    for r in result.rows:
        setting = ", ".join(f"{k}={v}" for k, v in r["_point"].items()) or "config as is"
        if r["status"] == "ok":
            mfu = f", MFU {r['mfu']:.1%}" if r.get("mfu") not in (None, "") else ""
            tflops = f", {r['tflops_per_device']:.3g} TFLOPS" if r.get("tflops_per_device") not in (None, "") else ""
            lines.append(f"bench: {r['point']} {setting}: {r['samples_per_s_per_device']:.3g} samples/s, step "
                         f"{r['step_time_p50_s']:.3g} s (p95 {r['step_time_p95_s']:.3g}), "
                         f"{r['peak_memory_mb']:.0f} MiB{tflops}{mfu}")
        else:
            lines.append(f"bench: {r['point']} {setting}: {r['status']} ({r['error']})")
    return [*lines, f"bench: wrote {result.csv} and {result.plot}"]


def best_lines(result: BenchResult) -> list[str]:
    """The fastest point that fit, and the config lines that select it (``result.best`` must be set)."""
    assert result.best is not None
    return [f"bench: fastest point that fits: {result.best['point']} "
            f"({result.best['samples_per_s_per_device']:.3g} samples/s per device); config lines:",
            result.best_config.rstrip() or "(the config as it is)"]
