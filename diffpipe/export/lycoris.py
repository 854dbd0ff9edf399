"""LoKr and LoHa adapters under original layer names, in LyCORIS naming (ComfyUI, A1111/Forge, kohya tools).

PEFT's LoKr and LoHa tensors already carry LyCORIS' names (``lokr_w1``, ``lokr_w2`` or
their factors ``lokr_w1_a/b``, ``lokr_w2_a/b``; ``hada_w1_a/b``, ``hada_w2_a/b``) and the
same products: LoKr ``kron(w1, w2)``, LoHa ``(w1_a @ w1_b) * (w2_a @ w2_b)``, times
``alpha / r``. The readers differ on that scale (ComfyUI and A1111 use alpha only for
factored LoKr matrices, and divide by the factor's rank), so the scale is multiplied into
the left factor and no ``.alpha`` is written: every reader then applies scale 1.0
(missing alpha), i.e. the trained delta.

A Kronecker or Hadamard product of one module cannot be one product of a fused original
layer (Flux's ``qkv`` holds q, k and v; a reordered layer swaps row blocks): such a layer
is refused by name; train those modules as plain LoRA or export diffusers/peft/merged.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import peft
import torch
from peft.tuners.lokr.layer import factorization
from safetensors.torch import save_file

from diffpipe.export.convert import _exact, _pattern_value
from diffpipe.export.import_checks import alpha_value, check_product
from diffpipe.export.keymaps import KeyMap, Layer
from diffpipe.export.metadata import tensors_digest
from diffpipe.export.original_io import DIGEST_KEY
from diffpipe.training.adapter import adapter_kind
from diffpipe.utils import atomic_path

#: Tensor names per kind (PEFT's and LyCORIS'); the first present of ``LEFT`` takes the scale.
TENSORS = {
    "lokr": ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b"),
    "loha": ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"),
}
LEFT = {"lokr": ("lokr_w1", "lokr_w1_a"), "loha": ("hada_w1_a",)}


@dataclass
class Product:
    """One module's LoKr or LoHa: its tensors and its scale ``alpha / r``."""

    kind: str
    tensors: dict[str, torch.Tensor]
    scale: float

    def folded(self) -> dict[str, torch.Tensor]:
        """The tensors with the scale in the left factor: the product at scale 1."""
        left = next(n for n in LEFT[self.kind] if n in self.tensors)
        return {**self.tensors, left: self.tensors[left] * self.scale}


def module_products(state_dict: dict[str, torch.Tensor], cfg: peft.PeftConfig) -> dict[str, Product]:
    """A LoKr or LoHa adapter's tensors (PEFT keys relative to the denoiser) as one ``Product`` per module."""
    kind = adapter_kind(cfg)
    if kind not in TENSORS:
        raise ValueError(f"not a LoKr or LoHa adapter: {kind}")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        module, _, leaf = key.rpartition(".")
        if leaf not in TENSORS[kind]:
            raise ValueError(f"{kind} adapter tensor {key}: not one of {', '.join(TENSORS[kind])} "
                             "(Tucker-decomposed convolutions are not supported)")
        parts.setdefault(module, {})[leaf] = value
    out = {}
    for module, tensors in parts.items():
        r = _pattern_value(cfg.rank_pattern or {}, module, cfg.r)
        alpha = _pattern_value(cfg.alpha_pattern or {}, module, cfg.alpha)
        out[module] = Product(kind, tensors, float(alpha) / float(r))
    return out


def refuse_restructured(products: dict[str, object], keymap: KeyMap, fmt: str, kind: str) -> dict[str, Layer]:
    """Each module's original layer; an error naming the layer where it is fused or reordered."""
    layers = {}
    for module in products:
        layer = keymap.by_module.get(module)
        if layer is None:
            raise ValueError(f"{keymap.family}: LoRA module {module} has no original name")
        if not layer.is_plain:
            others = [m for m in layer.modules if m != module]
            why = f"fuses {module} with {', '.join(others)}" if others else f"reorders the rows of {module}"
            raise ValueError(f"{fmt} format: the original layer {layer.original} {why}; a {kind} there cannot be "
                             f"written exactly as one {kind} of that layer. Export diffusers, peft or merged, or "
                             f"train these modules without {kind} (train.lora.targets)")
        layers[module] = layer
    return layers


def write_products(products: dict[str, Product], names: dict[str, str], out_file: str | Path,
                   metadata: dict[str, str] | None = None) -> Path:
    """Write ``<name>.<tensor>`` per module (``names``: module -> layer name in the file), scale folded, no alpha."""
    tensors = {f"{names[m]}.{leaf}": t.float().contiguous() for m, p in products.items()
               for leaf, t in p.folded().items()}
    header = {"format": "pt", **(metadata or {}), DIGEST_KEY: tensors_digest(tensors)}
    out_file = Path(out_file)
    with atomic_path(out_file) as tmp:
        save_file(tensors, str(tmp), metadata=header)
        tmp.chmod(0o644)  # files made inside mkdtemp's private folder are 0600
    return out_file


def read_products(tensors: dict[str, torch.Tensor], source: str,
                  expect: Callable[[str], tuple[int, ...] | None] | None = None) -> dict[str, Product]:
    """Layer name -> ``Product`` from a file's LyCORIS tensors, scale as ComfyUI and A1111 apply it.

    LoKr: ``alpha / dim`` only with alpha and a factored matrix (dim: rank of ``w2_b``, else of
    ``w1_b``); LoHa: ``alpha / rank``; 1.0 without alpha. Each layer is checked first
    (``import_checks.check_product``; ``expect``: a layer name's weight shape in the model, if known).
    """
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        name, _, leaf = key.rpartition(".")
        parts.setdefault(name, {})[leaf] = value.float()
    out = {}
    for name, t in parts.items():
        alpha = t.pop("alpha", None)
        kind = "lokr" if any(k.startswith("lokr_") for k in t) else "loha" if any(k.startswith("hada_") for k in t) else ""
        unknown = sorted(set(t) - set(TENSORS.get(kind, ())))
        if not kind or unknown:
            raise ValueError(f"{source}: layer {name} holds {unknown or sorted(t)}, not LoKr or LoHa tensors "
                             "(Tucker-decomposed convolutions and mixed kinds are not supported)")
        check_product(source, name, kind, t, expect(name) if expect else None)
        if alpha is not None:
            alpha = alpha_value(source, f"{name}.alpha", alpha)
        if kind == "loha":
            dim = t["hada_w1_b"].shape[0]
        else:
            dim = t["lokr_w2_b"].shape[0] if "lokr_w2_b" in t else t["lokr_w1_b"].shape[0] if "lokr_w1_b" in t else None
        scale = alpha / dim if alpha is not None and dim is not None else 1.0
        out[name] = Product(kind, t, scale)
    if len({p.kind for p in out.values()}) > 1:
        raise ValueError(f"{source}: mixes LoKr and LoHa layers; diffpipe adapters hold one kind")
    return out


def _lokr_shape(p: Product) -> tuple[int, int, int, int]:
    """``(out_l, in_m, out_k, in_n)``: the Kronecker factors' sizes."""
    t = p.tensors
    w1 = (t["lokr_w1"].shape if "lokr_w1" in t else (t["lokr_w1_a"].shape[0], t["lokr_w1_b"].shape[1]))
    w2 = (t["lokr_w2"].shape[:2] if "lokr_w2" in t else (t["lokr_w2_a"].shape[0], t["lokr_w2_b"].shape[1]))
    return w1[0], w1[1], w2[0], w2[1]


def _lokr_factor(products: dict[str, Product]) -> int:
    """PEFT's ``decompose_factor`` that gives every module the file's factor sizes."""
    shapes = [_lokr_shape(p) for p in products.values()]
    for factor in dict.fromkeys([-1, *(s[0] for s in shapes), *(s[1] for s in shapes)]):
        if all(factorization(ol * ok, factor) == (ol, ok) and factorization(im * i_n, factor) == (im, i_n)
               for ol, im, ok, i_n in shapes):
            return factor
    raise ValueError("LoKr layers split their dimensions by different factors; PEFT's LoKr uses one "
                     f"(factor sizes {shapes[:3]}...)")


def adapter_from_products(products: dict[str, Product]) -> tuple[dict[str, torch.Tensor], peft.PeftConfig]:
    """A PEFT LoKr/LoHa state dict and config reproducing these modules (rank and alpha per module)."""
    kind = next(iter(products.values())).kind
    ranks: dict[str, int] = {}
    for m, p in products.items():
        t = p.tensors
        if kind == "loha":
            ranks[m] = t["hada_w1_b"].shape[0]
        elif "lokr_w2_b" in t:
            ranks[m] = t["lokr_w2_b"].shape[0]
        elif "lokr_w1_b" in t:
            ranks[m] = t["lokr_w1_b"].shape[0]
        else:  # both whole: any rank that keeps them whole in PEFT (r >= half the larger side)
            ranks[m] = max(t["lokr_w2"].shape[:2])
    rank = max(ranks.values())
    common = {
        "r": rank,
        "alpha": rank,
        "target_modules": "|".join(re.escape(m) for m in sorted(products)),  # as ``adapter_from_loras``
        "rank_pattern": {_exact(m): r for m, r in ranks.items() if r != rank},
        "alpha_pattern": {_exact(m): p.scale * ranks[m] for m, p in products.items()
                          if p.scale * ranks[m] != rank},
    }
    if kind == "loha":
        config = peft.LoHaConfig(**common)
    else:
        both = any("lokr_w1_a" in p.tensors for p in products.values())
        config = peft.LoKrConfig(**common, decompose_both=both, decompose_factor=_lokr_factor(products))
    sd = {f"{m}.{leaf}": v.float().contiguous() for m, p in sorted(products.items()) for leaf, v in p.tensors.items()}
    return sd, config
