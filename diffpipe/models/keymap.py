"""The key-map vocabulary shared by every family.

A family's table lists, for each LoRA-able layer of the original checkpoint,
which rows of which of our modules (the diffusers module names we train on)
it is made of, in output-row order. Most layers are one whole module; fused
layers (Flux's ``qkv``, ``linear1``) are several, and a layer whose rows are
reordered (Flux's final modulation: shift/scale vs scale/shift) is one module
in two segments. Export and import both read only this table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

#: Module types a LoRA can target (PEFT supports these; Wan's patch embedding is a Conv3d).
LORA_LAYERS = (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Conv3d)


@dataclass(frozen=True)
class Segment:
    """Rows ``[start, start + size)`` of our module ``module``."""

    module: str
    start: int
    size: int


@dataclass(frozen=True)
class Layer:
    """One layer of the original checkpoint and the segments it is built from."""

    original: str  # path in the original checkpoint, without ``diffusion_model.``
    kohya: str  # kohya / A1111 LoRA name (``lora_unet_...``)
    segments: tuple[Segment, ...]
    #: Write the scale into ``up`` (alpha = rank) because a reference loader ignores alpha here.
    fold_scale: bool = False
    #: Write no ``.alpha`` (only with ``fold_scale``): a reference loader rejects one here.
    #: Every loader reads a missing alpha as alpha = rank, which ``fold_scale`` writes anyway.
    alpha_key: bool = True
    #: The name ComfyUI maps under ``diffusion_model.`` where it is not ``original`` (ComfyUI
    #: renames some layers of a checkpoint on load and maps LoRA names back for only some).
    comfy: str = ""

    @property
    def comfy_name(self) -> str:
        """The layer's name in the ComfyUI file (after ``diffusion_model.``)."""
        return self.comfy or self.original

    @property
    def modules(self) -> list[str]:
        """Our modules in this layer, in order of first appearance."""
        return list(dict.fromkeys(s.module for s in self.segments))

    @property
    def out_features(self) -> int:
        return sum(s.size for s in self.segments)

    @property
    def is_plain(self) -> bool:
        """One whole module, rows in order: tensors copy across unchanged."""
        return len(self.segments) == 1 and self.segments[0].start == 0


@dataclass
class KeyMap:
    """A family's table, indexed both ways."""

    family: str
    layers: list[Layer]
    #: The ComfyUI file names its tensors ``lora_A`` / ``lora_B`` (PEFT's names, which
    #: ComfyUI also reads) because diffusers' loader for this family reads only those.
    peft_names: bool = False
    by_original: dict[str, Layer] = field(init=False)
    by_kohya: dict[str, Layer] = field(init=False)
    by_module: dict[str, Layer] = field(init=False)

    def __post_init__(self) -> None:
        self.by_original = {layer.original: layer for layer in self.layers}
        self.by_kohya = {layer.kohya: layer for layer in self.layers}
        self.by_module = {}
        for layer in self.layers:
            for m in layer.modules:
                if m in self.by_module:
                    raise ValueError(f"{self.family} key map: module {m} appears in two layers")
                self.by_module[m] = layer
        for index, name in ((self.by_original, "original"), (self.by_kohya, "kohya")):
            if len(index) != len(self.layers):
                raise ValueError(f"{self.family} key map: duplicate {name} names")

    def check_covers(self, denoiser: torch.nn.Module) -> None:
        """Every LoRA-able module of ``denoiser`` is in the table with the right row counts."""
        for name, mod in denoiser.named_modules():
            if not isinstance(mod, LORA_LAYERS):
                continue
            if name not in self.by_module:
                raise ValueError(f"{self.family} key map: module {name} is not mapped")
            rows = sum(s.size for s in self.by_module[name].segments if s.module == name)
            out = mod.out_features if isinstance(mod, torch.nn.Linear) else mod.out_channels
            if rows != out:
                raise ValueError(f"{self.family} key map: {name} has {out} rows, table covers {rows}")


def plain(
    original: str, module: str, size: int, kohya: str, *, fold_scale: bool = False, alpha_key: bool = True
) -> Layer:
    return Layer(original, kohya, (Segment(module, 0, size),), fold_scale, alpha_key)


def kohya_name(path: str) -> str:
    """kohya's LoRA name for a module path: ``lora_unet_`` + the path with ``_`` for ``.``."""
    return "lora_unet_" + path.replace(".", "_")


def same_names(family: str, out_features: Mapping[str, int]) -> KeyMap:
    """The key map of a family whose original checkpoint uses diffusers' module names: every layer is its
    own module under the same path; kohya names are ``lora_unet_`` + that path."""
    return KeyMap(family, [plain(m, m, n, kohya_name(m)) for m, n in out_features.items()])


def layer(original: str, segments: list[Segment], **options: bool | str) -> Layer:
    """A layer named ``original`` in the checkpoint and ``kohya_name(original)`` in kohya files."""
    return Layer(original, kohya_name(original), tuple(segments), **options)


def whole_layers(pairs: Mapping[str, str], out_features: Mapping[str, int],
                 make: Callable[[str, list[Segment]], Layer] = layer) -> list[Layer]:
    """A layer per ``original -> ours`` pair whose module the model has (``out_features``: its module sizes),
    each the whole module; ``make`` builds a layer (default :func:`layer`). Absent modules (an optional
    embedder, a block kind a variant lacks) are skipped."""
    return [make(original, [Segment(ours, 0, out_features[ours])]) for original, ours in pairs.items()
            if ours in out_features]


def swapped_halves(module: str, size: int) -> list[Segment]:
    """``module``'s rows with its two halves swapped: a modulation that is (scale, shift) in
    diffusers and (shift, scale) in the original checkpoint."""
    half = size // 2
    return [Segment(module, half, half), Segment(module, 0, half)]
