"""The verify step's parts: a file's findings, strength on probe vectors, and the comfyui / kohya files
read by ComfyUI's key-mapping rules (``comfy_rules``). ``export.verify`` runs them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from diffpipe.export.comfy_rules import clip_lora_keys, placed_layers
from diffpipe.export.convert import Lora
from diffpipe.export.keymaps import KeyMap
from diffpipe.export.lycoris import Product
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


def kron_applied(w1: torch.Tensor, w2: tuple[torch.Tensor, ...], x: torch.Tensor) -> torch.Tensor:
    """``kron(w1, w2) @ x`` without forming the product: row ``i * c + k`` is ``(w1 @ X @ w2.T)[i, k]``,
    ``X`` being a column of ``x`` as ``[w1 columns, w2 columns]``. ``w2``: ``(w2,)`` or its factors
    ``(w2_a, w2_b)``, never multiplied out. A conv's ``w2`` is flattened (ComfyUI gives ``w1`` 1x1 kernel
    dimensions, so the flattened product is ``kron(w1, w2.flatten(1))``)."""
    w1, w2 = w1.flatten(1).double(), [t.flatten(1).double() for t in w2]
    n_in = w2[-1].shape[1]
    cols = []
    for j in range(x.shape[1]):
        y = w1 @ x[:, j].reshape(w1.shape[1], n_in)
        for t in reversed(w2):  # X @ (a @ b).T = (X @ b.T) @ a.T
            y = y @ t.T
        cols.append(y.reshape(-1))
    return torch.stack(cols, dim=1)


def hadamard_applied(a1, b1, a2, b2, x: torch.Tensor) -> torch.Tensor:
    """``((a1 @ b1) * (a2 @ b2)) @ x`` without forming either product: per column ``x_j``,
    ``sum_pq a1[i,p] (b1 diag(x_j) b2.T)[p,q] a2[i,q]``."""
    a1, b1, a2, b2 = (t.flatten(1).double() for t in (a1, b1, a2, b2))
    cols = [((a1 @ ((b1 * x[:, j]) @ b2.T)) * a2).sum(dim=1) for j in range(x.shape[1])]
    return torch.stack(cols, dim=1)


def product_applied(t: dict[str, torch.Tensor], scale: float, x: torch.Tensor) -> torch.Tensor:
    """``scale`` times a LoKr or LoHa layer's delta (``t``: its tensors by LyCORIS name) applied to ``x``."""
    if "hada_w1_a" in t:
        return scale * hadamard_applied(t["hada_w1_a"], t["hada_w1_b"], t["hada_w2_a"], t["hada_w2_b"], x)
    # w1 is small (factor x factor, or its factors): formed; w2 (the large one) stays factored
    w1 = t["lokr_w1"] if "lokr_w1" in t else t["lokr_w1_a"].double() @ t["lokr_w1_b"].double()
    w2 = (t["lokr_w2"],) if "lokr_w2" in t else (t["lokr_w2_a"], t["lokr_w2_b"])
    return scale * kron_applied(w1, w2, x)


def comfy_product_scale(t: dict[str, torch.Tensor]) -> float:
    """The scale ComfyUI gives a LyCORIS layer: LoHa ``alpha / rank(w1_b)``; LoKr ``alpha / dim`` only with a
    factored matrix (dim: the rank of ``w2_b``, else ``w1_b``); 1.0 without ``alpha``."""
    alpha = t.get("alpha")
    if alpha is None:
        return 1.0
    if "hada_w1_b" in t:
        return float(alpha) / t["hada_w1_b"].shape[0]
    dim = next((t[n].shape[0] for n in ("lokr_w2_b", "lokr_w1_b") if n in t), None)
    return float(alpha) / dim if dim is not None else 1.0


def _product_strength(name: str, parts: dict[str, torch.Tensor], layer, trained: dict[str, Product]) -> list[str]:
    """A LoKr / LoHa layer as ComfyUI applies it against PEFT's trained delta of its module (one module:
    the writer refuses fused and reordered layers)."""
    want = trained.get(layer.modules[0])
    n_in = _in_features(parts)
    x = probe(n_in)
    got = product_applied(parts, comfy_product_scale(parts), x)
    ref = (product_applied(want.tensors, want.scale, x) if want is not None
           else torch.zeros_like(got))
    return [f"{name} ({layer.modules[0]})"] if got.shape != ref.shape or differs(got, ref) else []


def _in_features(t: dict[str, torch.Tensor]) -> int:
    """The flattened input width of a LyCORIS layer's delta."""
    if "hada_w1_b" in t:
        return t["hada_w1_b"].flatten(1).shape[1]
    w1 = t["lokr_w1"].shape[1] if "lokr_w1" in t else t["lokr_w1_b"].shape[1]
    w2 = t["lokr_w2"].flatten(1).shape[1] if "lokr_w2" in t else t["lokr_w2_b"].flatten(1).shape[1]
    return w1 * w2


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


def check_original(file: Path, fmt: str, family: str, keymap: KeyMap,
                   trained: dict[str, Lora] | dict[str, Product] | None,
                   text: dict[str, dict[str, Lora]], text_layers: dict[str, int], *, comfy_model: bool = True,
                   ) -> FileCheck:
    """A comfyui or kohya file by ComfyUI's rules: every layer lands on a model weight, at the trained strength
    (``alpha / rank``, 1.0 without ``.alpha``; LoKr / LoHa by ``comfy_product_scale``). ``trained``: the
    denoiser's LoRAs, or its LoKr / LoHa products (None: placement only); ``text``: the trained encoders'
    LoRAs; ``text_layers``: their layer counts. ``comfy_model`` False:
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
            if trained and "down" in parts and "up" in parts:
                off += _fused_strength(name, parts, layer, trained)
            elif trained and any(k.startswith(("lokr_", "hada_")) for k in parts):
                off += _product_strength(name, parts, layer, trained)
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
