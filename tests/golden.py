"""Golden values of the tiny training runs: per-step losses and a fingerprint of the trained LoRA.

Each end-to-end module that already trains a family through ``diffpipe train``
(and ``export``) calls :func:`check_golden` on its finished run, so a change to
a family, the objective or the training loop that changes what is trained
fails a test, while the check adds no training of its own. The values live in
one file, ``tests/assets/golden_losses.json``, keyed by family, then by the
run (``module::fixture``).

What is compared, and why these tolerances:

* the first :data:`GOLDEN_STEPS` losses of ``train/metrics.jsonl``, relative
  tolerance :data:`LOSS_RTOL` (1e-5). A run repeats bit for bit on CPU (same
  seed, one thread), so the slack is only for float32 rounding of an
  equivalent computation: rewriting ``(1 - t) x0 + t noise`` as
  ``x0 + t (noise - x0)`` moved the losses by at most 1.8e-7 relative. What
  the check must catch moves them much more: a changed timestep draw, noise
  draw or input by whole percents; a 1 % larger logit-normal std by 1.2e-4 to
  3.8e-2 (14 of the 15 runs that draw logit-normal timesteps; Lumina2's moved
  less, its LoRA check failed); DDPM timesteps ``t * 999`` instead of
  ``t * 1000`` by 3.0e-4. 1e-5 sits 50x above the rounding and 10x below the
  smallest of these. That holds for the first step, which no update has
  touched yet; each later step's loss comes after Adam's updates, which turn
  rounding-sized gradient differences into full-sized steps for near-zero
  weights (see the LoRA below), so another CPU's kernels move it more: on an
  Intel Xeon with AVX-512 FP16 the FLUX.1 text-encoder run's losses moved by
  2.2e-7 at step 1 and by 1.2e-5 and 1.4e-5 at steps 2 and 3 from the values
  recorded on another machine (its LoRA within :data:`LORA_RTOL`). Later steps
  are therefore held to :data:`LOSS_RTOL_UPDATED` (5e-5): 3.5x that drift, still
  2.4x below the smallest change listed above, and those changes already move
  step 1.
* the trained LoRA: the sha256 of its tensors (names, dtypes, shapes and
  bytes, sorted by name; the safetensors header, which holds run metadata,
  is left out), exact. The tiny runs are bit-reproducible on CPU, in a fresh
  process and in any test order (demo clips are encoded repeatably for this:
  ``write_mp4(repeatable=True)``), so unchanged behaviour means unchanged
  bytes. This also catches what the losses cannot: a change to the last
  update (Adam's beta2, which step 1 ignores) or one the losses only graze
  (Lumina2's 1 % std change). Each tensor's absolute sum is stored beside it
  to say, on failure, which tensors moved and how far. Where the bytes
  differ the check passes when the sums moved, in total, by at most
  :data:`LORA_RTOL` (1e-5) of their total: that is the rounding another CPU's
  kernels give (a test machine with other vector units). The total, not each
  tensor, because Adam turns a rounding-sized gradient into a full-sized step
  in either direction: on an AMD EPYC test machine a near-zero ``lora_B`` of
  SD's ``time_emb_proj`` moved by 20 % of its own tiny sum while all the
  tensors together moved by 1.7e-7 to 5.1e-7 of theirs (sd, sd resume, Wan
  I2V), while Adam's beta2 at 0.99 instead of 0.999 moved it by 4.0e-5 to
  6.1e-5 in the two-step image runs (sd3, auraflow, lumina2, sdxl).

The values are CPU float32 values: on a CUDA machine (TF32 convolutions,
other kernels) the check skips with a reason rather than compare them.

Regenerate deliberately, after a change that is meant to change training
(one module's entries, or all of them with ``tests/stages tests/workflow``)::

    DIFFPIPE_UPDATE_GOLDEN=1 OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -p no:cacheprovider \\
        -k golden tests/stages/test_image_families.py

Then the checks write their entries (under a file lock, so xdist workers can
share the file) instead of comparing, and ``git diff tests/assets`` shows what
moved. A run with no stored entry fails, naming that command.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from diffpipe.paths import RunPaths
from diffpipe.training.metrics import read_metrics

GOLDEN_FILE = Path(__file__).parent / "assets" / "golden_losses.json"
UPDATE_ENV = "DIFFPIPE_UPDATE_GOLDEN"
GOLDEN_STEPS = 8  # the first steps are kept; the LoRA fingerprint covers the rest of a longer run
LOSS_RTOL = 1e-5  # step 1: before any update
LOSS_RTOL_UPDATED = 5e-5  # steps 2, ...: after Adam's updates (see the module doc)
LORA_RTOL = 1e-5


def run_losses(metrics: Path, steps: int = GOLDEN_STEPS) -> list[float]:
    """The per-step training losses of ``metrics.jsonl`` (steps 1, 2, ...), the first ``steps``."""
    rows = read_metrics(metrics)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), f"{metrics}: steps are not 1..n"
    return [float(r["loss"]) for r in rows[:steps]]


def lora_fingerprint(file: Path) -> dict:
    """sha256 of a safetensors file's tensors (name, dtype, shape, bytes; header metadata left out)."""
    digest, abs_sums = hashlib.sha256(), {}
    with safe_open(str(file), framework="pt") as f:
        for name in sorted(f.keys()):
            t = f.get_tensor(name).contiguous()
            digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            abs_sums[name] = float(t.double().abs().sum())
    return {"sha256": digest.hexdigest(), "tensors": len(abs_sums), "abs_sums": abs_sums}


def default_lora_files(paths: RunPaths) -> list[Path]:
    """The run's exported diffusers LoRA files (two for Wan 2.2 A14B's ``expert: both``)."""
    files = sorted(paths.export_dir.glob("pytorch_lora_weights*.safetensors"))
    assert files, f"no diffusers export under {paths.export_dir}: export 'diffusers' or pass lora_files"
    return files


def golden_entry(paths: RunPaths, lora_files: list[Path] | None = None) -> dict:
    """What is stored for one finished run."""
    files = default_lora_files(paths) if lora_files is None else lora_files
    return {"losses": run_losses(paths.metrics), "lora": {f.name: lora_fingerprint(f) for f in files}}


def check_golden(family: str, run: str, paths: RunPaths, *, lora_files: list[Path] | None = None) -> None:
    """Compare a finished run with ``golden_losses.json[family][run]`` (or write it, see the module doc).

    ``run`` names the run (``module::fixture``); ``lora_files`` default to the
    diffusers export (pass ``[paths.adapter_file]`` for a run without export).
    """
    if torch.cuda.is_available():
        pytest.skip("golden values are CPU float32 values; this run trained on CUDA")
    got = golden_entry(paths, lora_files)
    if os.environ.get(UPDATE_ENV) == "1":
        old = _write_entry(family, run, got)
        if old != got:  # visible in pytest's warning summary; `git diff tests/assets` shows the values
            warnings.warn(
                f"golden {family!r} / {run!r} {'recorded' if old is None else 'changed'} in {GOLDEN_FILE}", stacklevel=2
            )
        return
    stored = _read().get(family, {}).get(run)
    assert stored is not None, (
        f"no golden entry {family!r} / {run!r} in {GOLDEN_FILE}; record it deliberately with "
        f"{UPDATE_ENV}=1 (see tests/golden.py) and commit the file"
    )
    _compare(family, run, stored, got)


def _compare(family: str, run: str, want: dict, got: dict) -> None:
    where = f"golden {family!r} / {run!r} ({GOLDEN_FILE.name}; {UPDATE_ENV}=1 rewrites it if the change is meant)"
    assert len(got["losses"]) == len(want["losses"]), (
        f"{where}: {len(got['losses'])} losses, stored {len(want['losses'])}"
    )
    for step, (a, b) in enumerate(zip(got["losses"], want["losses"], strict=True), start=1):
        rtol = LOSS_RTOL if step == 1 else LOSS_RTOL_UPDATED
        assert math.isclose(a, b, rel_tol=rtol, abs_tol=0.0), (
            f"{where}: loss at step {step} is {a!r}, stored {b!r} (relative change {abs(a - b) / abs(b):.2e}, "
            f"tolerance {rtol:.0e})\n  run:    {got['losses']}\n  stored: {want['losses']}"
        )
    assert got["lora"].keys() == want["lora"].keys(), (
        f"{where}: LoRA files {sorted(got['lora'])}, stored {sorted(want['lora'])}"
    )
    for name, have in got["lora"].items():
        stored = want["lora"][name]
        if have["sha256"] == stored["sha256"]:
            continue
        sums, ref = have["abs_sums"], stored["abs_sums"]
        if sums.keys() != ref.keys():
            detail = f"tensor names differ: {sorted(set(sums) ^ set(ref))[:6]}"
        else:
            drift = sum(abs(sums[k] - ref[k]) for k in ref) / max(sum(abs(v) for v in ref.values()), 1e-30)
            if drift <= LORA_RTOL:  # other bytes, same training: another CPU's kernels round differently
                continue
            worst = max(sums, key=lambda k: abs(sums[k] - ref[k]) / max(abs(ref[k]), 1e-30))
            rel = abs(sums[worst] - ref[worst]) / max(abs(ref[worst]), 1e-30)
            detail = (
                f"the tensors' abs sums moved by {drift:.2e} of their total (tolerance {LORA_RTOL:.0e}); the most "
                f"in relative terms: {worst} {sums[worst]!r} vs {ref[worst]!r} (relative {rel:.2e})"
            )
        pytest.fail(
            f"{where}: LoRA {name} tensors differ (sha256 {have['sha256'][:12]}, "
            f"stored {stored['sha256'][:12]}); {detail}"
        )


def _read() -> dict:
    return json.loads(GOLDEN_FILE.read_text()) if GOLDEN_FILE.exists() else {}


def _write_entry(family: str, run: str, entry: dict) -> dict | None:
    """Set one entry, read-modify-write under an exclusive lock on the file itself (xdist workers).

    Returns the entry it replaced (None if new).
    """
    GOLDEN_FILE.parent.mkdir(parents=True, exist_ok=True)
    with open(GOLDEN_FILE, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        text = f.read()
        data = json.loads(text) if text.strip() else {}
        old = data.get(family, {}).get(run)
        data.setdefault(family, {})[run] = entry
        f.seek(0)
        f.truncate()
        f.write(json.dumps({k: dict(sorted(v.items())) for k, v in sorted(data.items())}, indent=1) + "\n")
    return old
