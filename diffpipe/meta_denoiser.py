"""The ``meta``-device denoiser :mod:`diffpipe.estimate` counts, and :class:`Reuse`, which shares it between
estimates.

Building a published denoiser on the ``meta`` device, adding its LoRA and tracing one training forward take
nearly all of an estimate's time, and a memory plan (:mod:`diffpipe.memory_plan`) asks up to a dozen
estimates of one model that differ only in memory settings (the docs' fits table a few more). Most of that
work does not depend on those settings, so a :class:`Reuse` does each part once per what it depends on:

- the denoiser (:class:`Build`): the published config, the dtype, what trains (:class:`Trainable`) and the
  modules the base weights change (:func:`module_kind`: ``fp8`` stores its layers as scaled fp8, ``int8``
  casts them layerwise; bf16 and ``nf4`` change no module, so they share one denoiser). It is built once,
  and the fp8 and int8 ones are copies of it, converted;
- what is counted of it (:class:`MetaDenoiser`): that, and ``train.base_weights``;
- the activations a forward saves: the denoiser's modules and the forward's inputs
  (``diffpipe.estimate.Forward``); one forward counts them with checkpointing and without
  (:func:`diffpipe.saved_activations.saved_bytes_each`). Block swap, activation offload, ZeRO and the
  optimizer are arithmetic on these figures, and cost nothing to vary.

A :class:`Reuse` keeps every figure it computed and at most two denoisers (the latest plain one and the
latest converted one), so it holds one or two meta models however many estimates it serves; leaving its
``with`` block drops them and hands the freed heap back to the system (:func:`release_freed_memory`).
"""

from __future__ import annotations

import copy
import ctypes
import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, TypeVar

import peft
import torch

from diffpipe.families.published import Published
from diffpipe.training import offload
from diffpipe.training.precision import (
    QUANTISED,
    ScaledFp8Linear,
    cast_layerwise_fp8,
    enable_fp8_base_weights,
    nf4_bytes,
    nf4_dequantise_bytes,
    quantised_layers,
)
from diffpipe.utils import stable_json

T = TypeVar("T")
PLAIN = "plain"


@dataclass(frozen=True)
class Trainable:
    """What trains: a LoRA of ``rank`` on PEFT's ``targets``, or (``rank`` None) the whole denoiser."""

    rank: int | None
    targets: tuple[str, ...] = ()


def module_kind(base_weights: str, trainable: Trainable) -> str:
    """The modules ``train.base_weights`` changes on the meta denoiser: ``fp8`` (under a LoRA) stores its
    layers as scaled fp8; ``int8`` casts them layerwise, which saves the 16-bit weight copy of each layer as
    int8's matmul does; bf16 and ``nf4`` change none (nf4's bytes are counted from the plain layers)."""
    if base_weights == "int8" or (base_weights == "fp8" and trainable.rank is not None):
        return base_weights
    return PLAIN


@dataclass(frozen=True)
class Build:
    """A meta denoiser: the published model at ``dtype``, what trains, and its :func:`module_kind`."""

    spec: Published
    dtype: torch.dtype
    trainable: Trainable
    kind: str = PLAIN

    def key(self) -> str:
        """Everything the denoiser is built from, as text."""
        return stable_json([asdict(self.spec), str(self.dtype), asdict(self.trainable), self.kind])

    def plain(self) -> tuple[torch.nn.Module, int, int]:
        """The denoiser with what trains marked (a LoRA added), no base-weight layer changed; with the
        parameter count and the largest parameter's elements before the LoRA."""
        denoiser = self.spec.build_meta().to(self.dtype)
        params = sum(p.numel() for p in denoiser.parameters())
        largest = max(p.numel() for p in denoiser.parameters())
        rank = self.trainable.rank
        if rank is None:
            denoiser.requires_grad_(True)
            return denoiser, params, largest
        denoiser.requires_grad_(False)
        denoiser.add_adapter(peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=list(self.trainable.targets)))
        denoiser.to(self.dtype)
        return denoiser, params, largest

    def convert(self, denoiser: torch.nn.Module) -> torch.nn.Module:
        """A plain denoiser's base-weight layers changed as :func:`module_kind` says (in place)."""
        if self.kind == "fp8":
            enable_fp8_base_weights(denoiser)
        elif self.kind == "int8":  # the layerwise casting that makes the meta forward save each 16-bit copy
            cast_layerwise_fp8(denoiser, self.dtype)
        return denoiser


@dataclass(frozen=True)
class MetaDenoiser:
    """What an estimate counts of the meta denoiser under one ``train.base_weights`` (see diffpipe.estimate)."""

    build: Build
    params: int
    largest: int  # elements of the largest parameter (before the LoRA)
    sizes: tuple[int, ...]  # elements of each trainable tensor
    frozen_bytes: int  # the frozen weights as stored
    workspace: int  # transient bytes beside the saved activations (the largest layer's dequantisation)
    block_bytes: tuple[int, ...]  # frozen bytes of each repeated block in call order
    checkpointable: bool  # diffusers' activation checkpointing applies

    @property
    def rank(self) -> int | None:
        return self.build.trainable.rank


@dataclass(frozen=True)
class _Built:
    module: torch.nn.Module
    params: int
    largest: int


class Reuse:
    """Figures of meta denoisers and their traced forwards, each computed once, for estimates that share
    them (module docstring). Use it as a context manager, or call :meth:`close`, to free what it holds.

    It holds the latest plain denoiser (a LoRA's takes seconds to add at real size) and the latest
    converted one, a copy of it (fp8 or int8 layers)."""

    def __init__(self) -> None:
        self._figures: dict[str, Any] = {}
        self._plain: tuple[str, _Built] | None = None  # (Build.key() of the plain build, its denoiser)
        self._converted: tuple[str, torch.nn.Module] | None = None

    def __enter__(self) -> Reuse:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop every figure and denoiser, and return the freed heap to the system."""
        self._figures.clear()
        self._plain = self._converted = None
        release_freed_memory()

    def denoiser(self, build: Build, base_weights: str) -> MetaDenoiser:
        """What an estimate counts of ``build`` under ``base_weights``."""
        return self._once(stable_json(["denoiser", build.key(), base_weights]), lambda: self._count(build, base_weights))

    def traced(self, meta: MetaDenoiser, forward: str, trace: Callable[[torch.nn.Module], T]) -> T:
        """``trace(denoiser)`` of ``meta``'s denoiser, once per ``forward`` (the text of what else it reads)."""
        return self._once(stable_json(["traced", meta.build.key(), forward]), lambda: trace(self._module(meta.build)))

    def _once(self, key: str, compute: Callable[[], T]) -> T:
        if key not in self._figures:
            self._figures[key] = compute()
        return self._figures[key]

    def _count(self, build: Build, base_weights: str) -> MetaDenoiser:
        plain = self._built(build)
        module = self._module(build)
        # fp8 stores its layers before they are counted; int8's casting comes after (it counts the 16-bit
        # layers it quantises): the plain denoiser's, which its copy was made from.
        frozen, workspace = frozen_bytes(module if build.kind == "fp8" else plain.module, base_weights,
                                         build.dtype.itemsize)
        blocks = tuple(sum(t.nbytes for t in offload.frozen_tensors(b)) for b in offload.swap_blocks(module))
        sizes = tuple(p.numel() for p in module.parameters() if p.requires_grad)
        return MetaDenoiser(build, plain.params, plain.largest, sizes, frozen, workspace, blocks,
                            bool(getattr(module, "_supports_gradient_checkpointing", False)))

    def _module(self, build: Build) -> torch.nn.Module:
        """The denoiser of ``build``: the plain one, or a converted copy of it (each held, else made)."""
        plain = self._built(build)
        if build.kind == PLAIN:
            return plain.module
        if self._converted is None or self._converted[0] != build.key():
            self._converted = None  # one converted denoiser at a time, even while the next is made
            # A copy costs a fraction of building and adding the LoRA again (FLUX.1-dev: 0.6 s against 2.3 s);
            # a trace leaves the plain denoiser as it was built.
            self._converted = (build.key(), build.convert(copy.deepcopy(plain.module)))
        return self._converted[1]

    def _built(self, build: Build) -> _Built:
        """The plain denoiser of ``build``'s model, dtype and trainable part: the one held, else built."""
        key = replace(build, kind=PLAIN).key()
        if self._plain is None or self._plain[0] != key:
            self._plain = self._converted = None  # another model: drop the last one's denoisers first
            module, params, largest = build.plain()
            self._plain = (key, _Built(module, params, largest))
        return self._plain[1]


def frozen_bytes(denoiser: torch.nn.Module, base_weights: str, width: int) -> tuple[int, int]:
    """Bytes of the frozen weights as stored (quantised ones at their size), and the transient bytes at the
    peak beside the saved activations (the largest layer's dequantisation under fp8 and nf4). ``denoiser``:
    a plain one (:meth:`Build.plain`), or fp8's (``width``: bytes per value of its dtype)."""
    total = sum(p.nbytes for p in denoiser.parameters() if not p.requires_grad)
    fp8 = [m for m in denoiser.modules() if isinstance(m, ScaledFp8Linear)]
    total += sum(m.weight.nbytes + m.weight_scale.nbytes for m in fp8)
    workspace = max((m.weight.numel() * width for m in fp8), default=0)
    if base_weights in QUANTISED:
        modules = dict(denoiser.named_modules())
        weights = [modules[n].weight for n in quantised_layers(denoiser, base_weights)]
        if base_weights == "int8":  # int8 weights and a float32 scale per output channel (torchao's layout)
            total -= sum(w.nbytes - w.numel() - 4 * w.shape[0] for w in weights)
        else:  # NF4: its autograd function saves the 4-bit weight itself, so the activations are bf16's
            total -= sum(w.nbytes - nf4_bytes(w.numel(), width) for w in weights)
            workspace = max((nf4_dequantise_bytes(w.numel(), width) for w in weights), default=0)
    return total, workspace


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere nothing). A meta
    denoiser is many small Python and C++ objects: after it is dropped, glibc keeps their pages for reuse,
    about 130 MB per FLUX.1-dev estimate, so a long loop of estimates grows without this."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` among the symbols this process has loaded; None without glibc (musl, macOS)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
