"""LoRA tensors between our modules and the original checkpoint's layers, exactly.

A LoRA on module m adds ``scale * up @ down`` to its weight, with
``scale = alpha / rank`` (rank = rows of ``down``), the rule PEFT, diffusers,
ComfyUI and kohya share. A fused original layer (Flux ``qkv``) gets
``down`` = the modules' ``down`` matrices stacked and ``up`` = their ``up``
matrices placed block-diagonally (zero rows for parts without a LoRA), each
block multiplied by its module's scale, and ``alpha = rank`` (scale 1). So the
fused delta equals the trained deltas row for row, with no approximation, in
every loader (diffusers' Flux converter ignores alpha on ``final_layer``, so a
restructured layer must not depend on it; ``Layer.fold_scale`` marks plain
layers treated the same way for that reason). Plain layers keep the trained
alpha. Import reverses this with the recorded block layout (module, rank,
alpha), or, for a fused LoRA made elsewhere, gives each part the whole
``down`` and its rows of ``up`` (also exact).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from dataclasses import dataclass

import peft
import torch

from diffpipe.export.keymaps import KeyMap, Layer


@dataclass
class Lora:
    """One low-rank update: ``delta = alpha / rank * up @ down`` (conv: flattened)."""

    down: torch.Tensor
    up: torch.Tensor
    alpha: float

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def delta(self) -> torch.Tensor:
        """The weight update, shaped like the layer's weight."""
        up, down = self.up.flatten(1).double(), self.down.flatten(1).double()
        d = self.scale * (up @ down)
        if self.down.ndim > 2:  # conv: [out, in, *kernel]
            return d.reshape(self.up.shape[0], *self.down.shape[1:]).float()
        return d.float()


# Layout of a fused layer: the column blocks of ``down``, as (module, rank, trained alpha) in order.
Layout = dict[str, list[tuple[str, int, float]]]


def _pattern_value(patterns: dict, module: str, default):
    # PEFT's rule: a pattern matches a module name or its dotted suffix.
    for pattern, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?({pattern})", module):
            return value
    return default


def module_loras(state_dict: dict[str, torch.Tensor], cfg: peft.LoraConfig) -> dict[str, Lora]:
    """Our adapter's tensors (PEFT keys relative to the denoiser) as one ``Lora`` per module."""
    mods: dict[str, Lora] = {}
    for key, down in state_dict.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removesuffix(".lora_A.weight")
        up = state_dict[f"{module}.lora_B.weight"]
        rank = down.shape[0]
        alpha = float(_pattern_value(cfg.alpha_pattern or {}, module, cfg.lora_alpha))
        if cfg.use_rslora:  # PEFT scales by alpha / sqrt(rank): express it as alpha' / rank
            alpha = alpha * math.sqrt(rank)
        mods[module] = Lora(down, up, alpha)
    other = [k for k in state_dict if not k.endswith((".lora_A.weight", ".lora_B.weight"))]
    if other:
        raise ValueError(f"adapter holds tensors that are not plain LoRA (DoRA, biases?): {other[:3]}")
    return mods


def fold_scale(state_dict: dict[str, torch.Tensor], cfg: peft.LoraConfig,
               ) -> tuple[dict[str, torch.Tensor], peft.LoraConfig]:
    """The same adapter with each module's scale multiplied into ``lora_B`` and alpha = rank.

    For files whose readers may ignore the alpha kept in a header (ComfyUI reads a
    diffusers file's tensors only, scale 1.0): every reader then applies the trained
    delta, and a reader that does read the header (diffusers' ``load_lora_weights``)
    finds alpha = rank, scale 1, so nothing is scaled twice. DoRA's magnitude is
    unchanged by this (it normalises ``W + scale * B @ A``, the same matrix).
    """
    plain = {k: v for k, v in state_dict.items() if not k.endswith(".lora_magnitude_vector")}  # DoRA's
    scales = {m: lora.scale for m, lora in module_loras(plain, cfg).items()}
    folded = {k: (v * scales[k.removesuffix(".lora_B.weight")] if k.endswith(".lora_B.weight") else v)
              for k, v in state_dict.items()}
    # alpha = rank per module: the same patterns for both, so every module resolves them alike.
    config = peft.LoraConfig(**{**config_fields(cfg), "lora_alpha": cfg.r, "alpha_pattern": dict(cfg.rank_pattern or {}),
                                "use_rslora": False})
    return folded, config


def config_fields(cfg: peft.LoraConfig) -> dict:
    """The constructor arguments of a PEFT config (its fields that ``__init__`` takes)."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}


def _exact(name: str) -> str:
    return r"(?<!\.)" + re.escape(name)


def adapter_from_loras(mods: dict[str, Lora], *, dropout: float = 0.0) -> tuple[dict[str, torch.Tensor], peft.LoraConfig]:
    """A PEFT state dict and config for these LoRAs (most common rank/alpha + patterns)."""
    if not mods:
        raise ValueError("no LoRA modules to write")
    rank = Counter(m.rank for m in mods.values()).most_common(1)[0][0]
    alpha = Counter(m.alpha for m in mods.values()).most_common(1)[0][0]
    # Exact names only. PEFT matches a pattern against any dotted suffix of a module
    # name, so ``proj_out`` would also catch ``single_transformer_blocks.0.proj_out``:
    # the lookbehind forbids a preceding dot, and targets are one full-match regex.
    rank_pattern = {_exact(k): m.rank for k, m in mods.items() if m.rank != rank}
    alpha_pattern = {_exact(k): m.alpha for k, m in mods.items() if m.alpha != alpha}
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules="|".join(re.escape(k) for k in sorted(mods)),
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
        init_lora_weights="gaussian",
    )
    sd = {}
    for k, m in sorted(mods.items()):
        sd[f"{k}.lora_A.weight"] = m.down.float().contiguous()
        sd[f"{k}.lora_B.weight"] = m.up.float().contiguous()
    return sd, config


def _fuse(layer: Layer, mods: dict[str, Lora]) -> tuple[Lora, list[tuple[str, int, float]]]:
    present = [m for m in layer.modules if m in mods]
    rank = sum(mods[m].rank for m in present)
    down = torch.cat([mods[m].down for m in present], dim=0)
    up = torch.zeros(layer.out_features, rank, *mods[present[0]].up.shape[2:], dtype=down.dtype)
    cols, col = {}, 0
    for m in present:
        cols[m] = (col, col + mods[m].rank)
        col += mods[m].rank
    row = 0
    for seg in layer.segments:
        if seg.module in cols:
            lora = mods[seg.module]
            c0, c1 = cols[seg.module]
            up[row : row + seg.size, c0:c1] = lora.up[seg.start : seg.start + seg.size] * lora.scale
        row += seg.size
    return Lora(down, up, float(rank)), [(m, mods[m].rank, mods[m].alpha) for m in present]


def to_original(mods: dict[str, Lora], keymap: KeyMap) -> tuple[dict[Layer, Lora], Layout]:
    """Our per-module LoRAs -> one LoRA per original layer (fused where the original fuses)."""
    unmapped = sorted(set(mods) - set(keymap.by_module))
    if unmapped:
        raise ValueError(f"{keymap.family}: {len(unmapped)} LoRA module(s) have no original name, e.g. {unmapped[:3]}")
    out: dict[Layer, Lora] = {}
    layout: Layout = {}
    for layer in keymap.layers:
        if not any(m in mods for m in layer.modules):
            continue
        if layer.is_plain and not layer.fold_scale:
            out[layer] = mods[layer.segments[0].module]
        else:
            out[layer], layout[layer.original] = _fuse(layer, mods)
    return out, layout


def from_original(loras: dict[Layer, Lora], layout: Layout | None = None) -> dict[str, Lora]:
    """One LoRA per original layer -> our per-module LoRAs (inverse of ``to_original``)."""
    mods: dict[str, Lora] = {}
    for layer, lora in loras.items():
        blocks = (layout or {}).get(layer.original)
        if layer.is_plain and blocks is None:
            mods[layer.segments[0].module] = lora
            continue
        if blocks is None:  # a fused LoRA made elsewhere: every part shares ``down`` and alpha
            cols = {m: (0, lora.rank, lora.alpha * 1.0) for m in layer.modules}
            fold = dict.fromkeys(layer.modules, 1.0)
        else:
            cols, fold, col = {}, {}, 0
            for m, r, alpha in blocks:
                cols[m] = (col, col + r, float(alpha))
                # The block holds scale_fused * scale_m * B_m: take out all but the trained scale.
                fold[m] = lora.scale / (alpha / r)
                col += r
            if col != lora.rank:
                raise ValueError(f"{layer.original}: layout ranks sum to {col}, the LoRA has rank {lora.rank}")
        ups: dict[str, torch.Tensor] = {}
        row = 0
        for seg in layer.segments:
            if seg.module in cols:
                c0, c1, _ = cols[seg.module]
                if seg.module not in ups:
                    rows = sum(s.size for s in layer.segments if s.module == seg.module)
                    ups[seg.module] = lora.up.new_zeros(rows, c1 - c0, *lora.up.shape[2:])
                ups[seg.module][seg.start : seg.start + seg.size] = lora.up[row : row + seg.size, c0:c1]
            row += seg.size
        for m, (c0, c1, alpha) in cols.items():
            if blocks is None:  # shared down: rank R, the file's alpha
                mods[m] = Lora(lora.down.clone(), ups[m].contiguous(), lora.alpha)
            else:
                mods[m] = Lora(lora.down[c0:c1].clone(), (ups[m] * fold[m]).contiguous(), alpha)
    return mods
