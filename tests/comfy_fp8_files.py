"""Single-file checkpoints in ComfyUI's fp8-scaled layout, written from a tiny model for the loader's tests.

The layout (restated from public fp8-scaled files, not copied): the original checkpoint's names; each
quantised Linear has ``<prefix>.weight`` in float8_e4m3fn and ``<prefix>.scale_weight`` in float32, one value
for the tensor or one per output row (weight = codes * scale); some have ``<prefix>.scale_input``; an empty
``scaled_fp8`` float8 tensor marks the file. A plain module, imported by name (``tests/`` is on the path).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

E4M3_MAX = 448.0


def quantise(weight: torch.Tensor, per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)``: float8 codes and a float32 scale (``[rows]`` per row, or a 0-d tensor), written as
    such files are: the largest magnitude maps to e4m3's largest value."""
    w = weight.float()
    top = w.abs().amax(dim=1) if per_row else w.abs().amax()
    scale = torch.where(top > 0, top / E4M3_MAX, torch.ones_like(top))
    codes = (w / (scale[:, None] if per_row else scale)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def write_fp8_scaled(original: dict[str, torch.Tensor], path: Path, *, per_row: bool,
                     keep: Callable[[str], bool] = lambda key: False) -> dict[str, torch.Tensor]:
    """Write ``original`` (original names) to ``path`` in the fp8-scaled layout: every 2-D ``*.weight`` but
    those ``keep`` names quantised (every other one also gets a ``scale_input``). Returns the same dict with
    each quantised weight replaced by its float32 dequantised value, codes * scale: the model the file holds."""
    out, held = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}, {}
    for i, (key, value) in enumerate(sorted(original.items())):
        if value.ndim != 2 or not key.endswith(".weight") or keep(key):
            out[key] = held[key] = value.contiguous()
            continue
        codes, scale = quantise(value, per_row)
        prefix = key[: -len(".weight")]
        out[key], out[f"{prefix}.scale_weight"] = codes, scale
        if i % 2:
            out[f"{prefix}.scale_input"] = torch.ones(())
        held[key] = codes.float() * (scale[:, None] if per_row else scale)
    save_file(out, str(path))
    return held


_ZIMAGE_RENAMES = [("all_final_layer.2-1.", "final_layer."), ("all_x_embedder.2-1.", "x_embedder."),
                   (".attention.to_out.0.", ".attention.out."), (".attention.norm_k.", ".attention.k_norm."),
                   (".attention.norm_q.", ".attention.q_norm.")]


def zimage_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Z-Image transformer's state dict in the original checkpoint's names under ``model.diffusion_model.``:
    each attention's ``to_q``, ``to_k``, ``to_v`` fused into one ``qkv`` (row blocks in that order)."""
    out = {}
    for key, value in state.items():
        if ".attention.to_k." in key or ".attention.to_v." in key:
            continue
        if ".attention.to_q." in key:
            parts = [state[key.replace("to_q", part)] for part in ("to_q", "to_k", "to_v")]
            key, value = key.replace(".attention.to_q.", ".attention.qkv."), torch.cat(parts)
        for ours, theirs in _ZIMAGE_RENAMES:
            key = key.replace(ours, theirs)
        out[f"model.diffusion_model.{key}"] = value
    return out
