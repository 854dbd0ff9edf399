"""The memory-fits table of docs/training.md: each flagship's estimate at rank 16 under each memory option,
and the setting :mod:`diffpipe.memory_plan` chooses for 24 / 16 / 12 GiB cards (``make docs`` writes it;
``diffpipe.estimate`` counts the bytes)."""

from __future__ import annotations

from typing import Any

from diffpipe.config import Config
from diffpipe.estimate import GiB, estimate_memory
from diffpipe.memory_plan import Estimator, NothingFits, plan_memory
from diffpipe.meta_denoiser import Reuse

#: The families the fits table covers: (label, published model, family, width, height, frames,
#: published figures of other trainers for the same model, as their documentation gives them).
FITS_MODELS = (
    ("FLUX.1-dev", "flux1-dev", "flux", 1024, 1024, 1,
     "SimpleTuner, rank-16 LoRA: >30 GB bf16, 18 int8, 13 int4, 9 nf4 base weights"),
    ("Qwen-Image", "qwen-image", "qwenimage", 1024, 1024, 1,
     "musubi-tuner, 1024 px: 42 GB bf16, 30 fp8, 24 fp8 + 16 blocks swapped, 12 with 45 swapped"),
    ("Wan 2.1 T2V 14B", "wan2.2-t2v-a14b", "wan", 832, 480, 81,
     "musubi-tuner users report ~96 GB of system RAM for Wan 2.2 with offloading"),
    ("Wan 2.1 T2V 14B", "wan2.2-t2v-a14b", "wan", 832, 480, 33, ""),
    ("FLUX.2 [dev]", "flux2-dev", "flux2", 1024, 1024, 1, ""),
    ("FLUX.2 [klein] 4B", "flux2-klein-4b", "flux2-klein", 1024, 1024, 1, ""),
    ("Z-Image Turbo", "z-image-turbo", "zimage", 1024, 1024, 1, ""),
    ("Krea 2", "krea-2", "krea2", 1024, 1024, 1, ""),
    ("ERNIE-Image", "ernie-image", "ernie-image", 1024, 1024, 1, ""),
    ("Ideogram 4", "ideogram-4", "ideogram4", 1024, 1024, 1, ""),
    ("Helios-Base 14B, first chunk", "helios-14b", "helios", 832, 480, 33, ""),
    ("LTX-2 19B, video stream", "ltx-2-19b", "ltx2", 768, 512, 121,
     "SimpleTuner field reports (480p, 17 frames, batch 2): ~48 GB bf16 without offload, ~30 GB int8"),
    ("Kandinsky 5.0 T2V Lite", "kandinsky-5-t2v-lite", "kandinsky5", 768, 512, 121, ""),
    ("Kandinsky 5.0 Image Lite", "kandinsky-5-image-lite", "kandinsky5-image", 1024, 1024, 1, ""),
)
CARDS_GIB = (24, 16, 12)


def _fits_config(family: str, **train) -> Config:
    return Config.model_validate(
        {"model": {"family": family}, "datasets": [{"name": "d", "path": "data", "resolution": 1024}],
         "train": {"batch_size": 1, "precision": "bf16", "lora": {"rank": 16}, **train}})


def shared_estimator(reuse: Reuse, **sizes: Any) -> Estimator:
    """``estimate_memory`` at ``sizes``, sharing ``reuse``'s meta denoisers and traces (the option columns and
    every card's plan ask for the same few)."""
    return lambda cfg: estimate_memory(cfg, reuse=reuse, **sizes)


def fits_row(entry: tuple, estimate: Estimator) -> str:
    """One row of :func:`fits_markdown` for a ``FITS_MODELS`` entry: its estimate under each of ``FITS_OPTIONS``,
    and per card what :func:`diffpipe.memory_plan.plan_memory` chooses (``train.memory: auto``, no system-RAM
    limit), with its estimate and relative step time."""
    label, _, family, width, height, frames, peers = entry
    bf16, fp8, ckpt, offloaded, nf4 = (estimate(_fits_config(family, **o)) for o in FITS_OPTIONS)
    everything = ckpt.swapped(len(ckpt.block_bytes))
    both = offloaded.swapped(len(offloaded.block_bytes))
    size = f"{width}x{height}" + (f" x {frames} frames" if frames > 1 else "")
    cells = [f"{label} ({size})"] + [f"{e.total_bytes / GiB:.1f} GiB" for e in (bf16, fp8, ckpt)]
    cells.append(f"{everything.total_bytes / GiB:.1f} GiB ({everything.cpu_bytes / GiB:.1f} GiB)")
    cells.append(f"{both.total_bytes / GiB:.1f} GiB ({(both.cpu_bytes + both.activation_cpu_bytes) / GiB:.1f} GiB)")
    cells.append(f"{nf4.total_bytes / GiB:.1f} GiB")
    for card in CARDS_GIB:
        try:
            cells.append(plan_memory(_fits_config(family), card * GiB, estimate=estimate).chosen.short())
        except NothingFits:
            cells.append("nothing fits")
    return "| " + " | ".join([*cells, peers]) + " |"


_FP8_CKPT = {"base_weights": "fp8", "activation_checkpointing": True}
FITS_OPTIONS = ({}, {"base_weights": "fp8"}, _FP8_CKPT, {**_FP8_CKPT, "activation_offload": True},
                {"base_weights": "nf4", "activation_checkpointing": True})


def fits_markdown() -> str:
    """The docs table: each flagship's estimate at rank 16 under each memory option, and the setting the
    memory planner chooses for 24 / 16 / 12 GiB cards (one source of truth with ``train.memory: auto``)."""
    rows = [
        "| model (size) | bf16 | fp8 | fp8 + checkpointing | + every block swapped (system RAM) | "
        "+ activation offload (system RAM) | nf4 + checkpointing | "
        + " | ".join(f"fits {c} GiB" for c in CARDS_GIB) + " | other trainers' published figures |",
        "| --- " * (8 + len(CARDS_GIB)) + "|",
    ]
    for entry in FITS_MODELS:
        _, model, _, width, height, frames, _ = entry
        kw = {"model": model, "resolution": width, "height": height, "frames": frames}
        with Reuse() as reuse:  # one model at a time: its denoisers are freed before the next is built
            rows.append(fits_row(entry, shared_estimator(reuse, **kw)))
    return "\n".join(rows)
