"""The memory-fits table of docs/training.md: each flagship's estimate at rank 16 under each memory option,
and the cheapest setting that fits 24 / 16 / 12 GiB cards (``make docs`` writes it; ``diffpipe.estimate``
counts the bytes)."""

from __future__ import annotations

from diffpipe.config import Config
from diffpipe.estimate import GiB, MemoryEstimate, estimate_memory

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
#: What the CUDA context and the allocator's fragmentation add to an estimate (diffpipe.estimate's docstring: 1-2 GiB).
CONTEXT_BYTES = 3 * GiB // 2
CARDS_GIB = (24, 16, 12)


def _fits_config(family: str, **train) -> Config:
    return Config.model_validate(
        {"model": {"family": family}, "datasets": [{"name": "d", "path": "data", "resolution": 1024}],
         "train": {"batch_size": 1, "precision": "bf16", "lora": {"rank": 16}, **train}})


def fits_row(entry: tuple, bf16: MemoryEstimate, fp8: MemoryEstimate, ckpt: MemoryEstimate,
             offloaded: MemoryEstimate, nf4: MemoryEstimate) -> str:
    """One row of :func:`fits_markdown` for a ``FITS_MODELS`` entry from its five estimates (``FITS_OPTIONS``).

    The cheapest setting that fits is taken along the fp8 chain (fp8, checkpointing, block swap, activation
    offload); where that needs system RAM (or nothing fits) and nf4 + checkpointing fits without it, the
    cell names that too: 4-bit weights round more, swapping costs speed."""
    label, _, _, width, height, frames, peers = entry
    everything = ckpt.swapped(len(ckpt.block_bytes))
    both = offloaded.swapped(len(offloaded.block_bytes))
    size = f"{width}x{height}" + (f" x {frames} frames" if frames > 1 else "")
    cells = [f"{label} ({size})"] + [f"{e.total_bytes / GiB:.1f} GiB" for e in (bf16, fp8, ckpt)]
    cells.append(f"{everything.total_bytes / GiB:.1f} GiB ({everything.cpu_bytes / GiB:.1f} GiB)")
    cells.append(f"{both.total_bytes / GiB:.1f} GiB ({(both.cpu_bytes + both.activation_cpu_bytes) / GiB:.1f} GiB)")
    cells.append(f"{nf4.total_bytes / GiB:.1f} GiB")
    for card in CARDS_GIB:
        budget = card * GiB - CONTEXT_BYTES
        if bf16.total_bytes <= budget:
            cell = "bf16"
        elif fp8.total_bytes <= budget:
            cell = "fp8"
        elif (n := ckpt.swap_to_fit(budget)) is not None:
            cell = "fp8 + checkpointing" + (f" + block_swap {n}" if n else "")
        elif (n := offloaded.swap_to_fit(budget)) is not None:
            cell = "fp8 + checkpointing + activation_offload" + (f" + block_swap {n}" if n else "")
        else:
            cell = "no"
        if ("block_swap" in cell or "offload" in cell or cell == "no") and nf4.total_bytes <= budget:
            cell = "nf4 + checkpointing" if cell == "no" else f"{cell}, or nf4 + checkpointing"
        cells.append(cell)
    return "| " + " | ".join([*cells, peers]) + " |"


_FP8_CKPT = {"base_weights": "fp8", "activation_checkpointing": True}
FITS_OPTIONS = ({}, {"base_weights": "fp8"}, _FP8_CKPT, {**_FP8_CKPT, "activation_offload": True},
                {"base_weights": "nf4", "activation_checkpointing": True})


def fits_markdown() -> str:
    """The docs table: each flagship's estimate at rank 16 under each memory option, and the
    cheapest setting that fits 24 / 16 / 12 GiB cards (estimate + 1.5 GiB of CUDA context)."""
    rows = [
        "| model (size) | bf16 | fp8 | fp8 + checkpointing | + every block swapped (system RAM) | "
        "+ activation offload (system RAM) | nf4 + checkpointing | "
        + " | ".join(f"fits {c} GiB" for c in CARDS_GIB) + " | other trainers' published figures |",
        "| --- " * (8 + len(CARDS_GIB)) + "|",
    ]
    for entry in FITS_MODELS:
        _, model, family, width, height, frames, _ = entry
        kw = {"model": model, "resolution": width, "height": height, "frames": frames}
        rows.append(fits_row(entry, *(estimate_memory(_fits_config(family, **o), **kw) for o in FITS_OPTIONS)))
    return "\n".join(rows)
