"""The verify step's parts: a file's findings, strength on probe vectors, and the comfyui / kohya files
read by ComfyUI's key-mapping rules (``comfy_rules``). ``export.verify`` runs them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from diffpipe.export.comfy_rules import clip_lora_keys, placed_layers
from diffpipe.export.convert import Lora
from diffpipe.export.keymaps import KeyMap
from diffpipe.export.original_io import ALPHA, DOWN, UP

#: Relative tolerance of a strength comparison (float32 tensors, float64 arithmetic).
RTOL = 1e-4
_SHOWN = 5  # keys named per problem


@dataclass
class FileCheck:
    """One exported file as its reader saw it."""

    file: Path
    fmt: str
    reader: str
    placed: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def keys(self, what: str, keys: list[str] | set[str]) -> None:
        """Record a problem ``what`` about ``keys`` (sorted, the first few named)."""
        if keys:
            shown = sorted(keys)
            more = f" and {len(shown) - _SHOWN} more" if len(shown) > _SHOWN else ""
            self.problems.append(f"{len(shown)} {what}: {', '.join(shown[:_SHOWN])}{more}")


# -- strength on probe vectors ------------------------------------------------------------------------
def probe(in_features: int) -> torch.Tensor:
    """Fixed random input columns for ``delta @ x`` (the same for the file and the trained side)."""
    return torch.randn(in_features, 2, generator=torch.Generator().manual_seed(in_features), dtype=torch.float64)


def applied(down: torch.Tensor, up: torch.Tensor, scale: float, x: torch.Tensor) -> torch.Tensor:
    """``scale * up @ down @ x`` without forming ``up @ down`` (conv kernels flattened)."""
    return scale * (up.flatten(1).double() @ (down.flatten(1).double() @ x))


def lora_applied(lora: Lora, x: torch.Tensor) -> torch.Tensor:
    return applied(lora.down, lora.up, lora.scale, x)


def differs(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool((got - want).abs().max() > RTOL * max(1.0, float(want.abs().max())))


# -- comfyui and kohya files: ComfyUI's key map ---------------------------------------------------------
def _layer_tensors(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, dict[str, torch.Tensor]], list[str]]:
    """Layer name -> {"down", "up", "alpha" or a LyCORIS leaf: tensor}; keys no reader takes as a LoRA part."""
    layers: dict[str, dict[str, torch.Tensor]] = {}
    odd = []
    for key, t in tensors.items():
        for kind, suffixes in (("down", DOWN), ("up", UP), ("alpha", (ALPHA,))):
            suffix = next((s for s in suffixes if key.endswith(s)), None)
            if suffix:
                layers.setdefault(key.removesuffix(suffix), {})[kind] = t
                break
        else:
            name, _, leaf = key.rpartition(".")
            if leaf.startswith(("lokr_", "hada_")):
                layers.setdefault(name, {})[leaf] = t
            else:
                odd.append(key)
    return layers, odd


def check_original(file: Path, fmt: str, family: str, keymap: KeyMap, trained: dict[str, Lora] | None,
                   text: dict[str, dict[str, Lora]], text_layers: dict[str, int], *, comfy_model: bool = True,
                   ) -> FileCheck:
    """A comfyui or kohya file by ComfyUI's rules: every layer lands on a model weight, at the trained strength
    (``alpha / rank``, 1.0 without ``.alpha``). ``trained``: the denoiser's LoRAs (None: LoKr/LoHa, placement
    only); ``text``: the trained encoders' LoRAs; ``text_layers``: their layer counts. ``comfy_model`` False:
    ComfyUI has no model for the family, so names are checked against the family's own table."""
    from safetensors.torch import load_file  # deferred: only the export job verifies (start-up time)

    check = FileCheck(file, fmt, "ComfyUI key map" if comfy_model else f"{family} key map (no ComfyUI model)")
    if comfy_model:
        unet = placed_layers(family, keymap.layers)
    else:
        unet = {("diffusion_model." + la.comfy_name if fmt == "comfyui" else la.kohya): la for la in keymap.layers}
    clip = clip_lora_keys(text_layers, sdxl=family == "sdxl")
    layers, odd = _layer_tensors(load_file(str(file)))
    check.keys("tensor(s) are no LoRA part", odd)
    unplaced, off, covered, covered_text = [], [], set(), set()
    for name, parts in layers.items():
        if name in unet:
            layer = unet[name]
            covered |= set(layer.modules)
            if trained is not None and "down" in parts and "up" in parts:
                off += _fused_strength(name, parts, layer, trained)
        elif name in clip:
            encoder, path = clip[name]
            module = next((m for m in (path, path.removeprefix("text_model.")) if m in text.get(encoder, {})), path)
            covered_text.add(f"{encoder}.{module}")
            want = text.get(encoder, {}).get(module)
            if want is None:
                off.append(f"{name} (not trained)")
            elif "down" in parts and _scaled(parts, want):
                off.append(name)
        else:
            unplaced.append(name)
        check.placed += name not in unplaced
    check.keys(f"layer(s) {'ComfyUI' if comfy_model else 'the key map'} places on no model weight", unplaced)
    check.keys("layer(s) at another strength than trained", off)
    missing = set(trained or {}) - covered
    missing |= {f"{e}.{m}" for e, mods in text.items() for m in mods} - covered_text
    check.keys("trained module(s) missing from the file", missing)
    return check


def _scale(parts: dict[str, torch.Tensor]) -> float:
    alpha = parts.get("alpha")  # ComfyUI: alpha / rank, and 1.0 when the file has no alpha
    return float(alpha) / parts["down"].shape[0] if alpha is not None else 1.0


def _scaled(parts: dict[str, torch.Tensor], want: Lora) -> bool:
    """Whether a plain layer's LoRA differs in strength from ``want``."""
    x = probe(parts["down"].flatten(1).shape[1])
    return differs(applied(parts["down"], parts["up"], _scale(parts), x), lora_applied(want, x))


def _fused_strength(name: str, parts: dict[str, torch.Tensor], layer, trained: dict[str, Lora]) -> list[str]:
    """An original layer's rows against its modules' trained rows (a module without a LoRA: zero rows)."""
    x = probe(parts["down"].flatten(1).shape[1])
    got = applied(parts["down"], parts["up"], _scale(parts), x)
    row, off = 0, []
    for seg in layer.segments:
        want = trained.get(seg.module)
        rows = (lora_applied(want, x)[seg.start:seg.start + seg.size] if want is not None
                else torch.zeros(seg.size, x.shape[1], dtype=x.dtype))
        if differs(got[row:row + seg.size], rows):
            off.append(f"{name} ({seg.module})")
        row += seg.size
    return off
