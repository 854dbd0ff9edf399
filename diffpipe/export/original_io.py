"""Read and write LoRA files keyed by layer name (ComfyUI and kohya share the tensor layout)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from diffpipe.export.convert import Layout, Lora
from diffpipe.export.import_checks import alpha_value, check_lora, fused_layout
from diffpipe.export.metadata import tensors_digest
from diffpipe.utils import atomic_path, stable_json

LAYOUT_KEY = "diffpipe.fused_layout"
DIGEST_KEY = "diffpipe.tensors_sha256"
# Tensor suffixes ComfyUI accepts for down / up, kohya's first.
DOWN = (".lora_down.weight", ".lora_A.weight", ".lora.down.weight")
UP = (".lora_up.weight", ".lora_B.weight", ".lora.up.weight")
ALPHA = ".alpha"


def write_original(loras: dict[str, Lora], layout: Layout, out_file: str | Path,
                   metadata: dict[str, str] | None = None, *, without_alpha: frozenset[str] = frozenset(),
                   peft_names: bool = False) -> Path:
    """Write ``name.lora_down.weight`` / ``.lora_up.weight`` / ``.alpha`` per layer name.

    Names in ``without_alpha`` (alpha = rank, see ``Layer.alpha_key``) get no ``.alpha``;
    ``peft_names`` writes ``lora_A`` / ``lora_B`` for down / up (``KeyMap.peft_names``).
    """
    down, up = (DOWN[1], UP[1]) if peft_names else (DOWN[0], UP[0])
    tensors: dict[str, torch.Tensor] = {}
    for name, lora in loras.items():
        tensors[f"{name}{down}"] = lora.down.float().contiguous()
        tensors[f"{name}{up}"] = lora.up.float().contiguous()
        if name in without_alpha:
            if lora.alpha != lora.rank:
                raise ValueError(f"{name}: alpha {lora.alpha} != rank {lora.rank} cannot be written without alpha")
            continue
        tensors[f"{name}{ALPHA}"] = torch.tensor(float(lora.alpha), dtype=torch.float32)
    header = {"format": "pt", **(metadata or {}), DIGEST_KEY: tensors_digest(tensors)}
    if layout:
        header[LAYOUT_KEY] = stable_json(layout)
    out_file = Path(out_file)
    with atomic_path(out_file) as tmp:
        save_file(tensors, str(tmp), metadata=header)
        tmp.chmod(0o644)  # files made inside mkdtemp's private folder are 0600
    return out_file


def read_original(path: str | Path, expect: Callable[[str], tuple[int, ...] | None] | None = None,
                  ) -> tuple[dict[str, Lora], Layout | None, dict[str, str]]:
    """Layer name -> ``Lora`` (alpha = rank when the file has none), the fused layout, the header.

    Every layer is checked (``import_checks``): ranks, finite values, alpha; ``expect`` gives a layer
    name's weight shape in the model (None: not known here) to check the matrices' shapes against.
    """
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        header = dict(f.metadata() or {})
    parts: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    unknown = []
    for key, t in tensors.items():
        for kind, suffixes in (("down", DOWN), ("up", UP), ("alpha", (ALPHA,))):
            suffix = next((s for s in suffixes if key.endswith(s)), None)
            if suffix:
                parts.setdefault(key.removesuffix(suffix), {})[kind] = (key, t)
                break
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"{path}: {len(unknown)} tensor(s) are not LoRA down/up/alpha (DoRA, LoKr, biases "
                         f"are not supported), e.g. {unknown[:3]}")
    loras = {}
    for name, p in parts.items():
        if "down" not in p or "up" not in p:
            raise ValueError(f"{path}: layer {name} lacks its {'down' if 'down' not in p else 'up'} matrix")
        (down_key, down), (up_key, up) = p["down"], p["up"]
        check_lora(path, (down_key, up_key), down, up, expect(name) if expect else None)
        alpha = alpha_value(path, *p["alpha"]) if "alpha" in p else float(down.shape[0])
        loras[name] = Lora(down.float(), up.float(), alpha)
    layout = fused_layout(path, LAYOUT_KEY, header[LAYOUT_KEY]) if LAYOUT_KEY in header else None
    return loras, layout, header
