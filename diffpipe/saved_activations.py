"""Bytes a training step keeps for backward, counted by running the forward on the ``meta`` device
(:mod:`diffpipe.estimate` adds the weights, gradients and optimizer states; see its module docstring)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch


@contextmanager
def _fused_attention() -> Iterator[None]:
    """``scaled_dot_product_attention`` as a fused GPU kernel keeps it for backward (see module doc)."""

    class _Fused(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out = q.new_empty((*q.shape[:-1], v.shape[-1]))
            lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, grad):  # never run: the estimate stops after the forward
            q, k, v, _, _ = ctx.saved_tensors
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if enable_gqa and key.shape[-3] != query.shape[-3]:
            rep = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(rep, -3), value.repeat_interleave(rep, -3)
        return _Fused.apply(query, key, value)

    original = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


@contextmanager
def _meta_autocast_disabled() -> Iterator[None]:
    """``torch.autocast(device_type="meta", enabled=False)`` as a no-op: exact on meta, where no autocast is
    ever active, and the only way ERNIE-Image's, Ideogram 4's and Helios' rotary embeddings run there (torch
    has no autocast for the meta device). An enabled one (Mochi's) still raises."""
    original = torch.autocast

    def autocast(device_type: str, *args, enabled: bool = True, **kwargs):
        if device_type == "meta" and not enabled:
            return nullcontext()
        return original(device_type, *args, enabled=enabled, **kwargs)

    torch.autocast = autocast
    try:
        yield
    finally:
        torch.autocast = original


def saved_activation_bytes(denoiser: torch.nn.Module, run, *, checkpointing: bool = False,
                           fraction: float = 1.0, offload: bool = False) -> tuple[int, int]:
    """Bytes autograd saves for backward while ``run()`` does a forward (weights excluded), as
    ``(on the device, in CPU memory)``.

    ``checkpointing``: the peak under diffusers' activation checkpointing (see the module docstring).
    ``offload`` (``train.activation_offload``): see :func:`placed`.
    """
    held, largest = saved_bytes(denoiser, run, checkpointing=checkpointing, fraction=fraction)
    return placed(held, largest, checkpointing=checkpointing, offload=offload)


def placed(held: int, largest: int, *, checkpointing: bool, offload: bool) -> tuple[int, int]:
    """``(on the device, in CPU memory)`` of what a forward saves (:func:`saved_bytes`: ``held`` until the
    backward pass, ``largest`` block's own saves). Under checkpointing the device also holds that block's saves
    while it is recomputed. ``offload`` (``train.activation_offload``): everything saved until the backward
    pass waits in CPU memory; the device holds the largest block's own saves, brought back (or recomputed)
    for its backward. A denoiser without blocks diffusers checkpoints keeps everything on the device."""
    if offload and largest:
        return largest, held
    return held + (largest if checkpointing else 0), 0


def saved_bytes(denoiser: torch.nn.Module, run, *, checkpointing: bool = False,
                fraction: float = 1.0) -> tuple[int, int]:
    """Bytes saved for backward until the backward pass, and the largest block's own saves.

    ``fraction`` < 1 (``train.checkpoint_fraction``): only the first ``ceil(fraction * N)`` blocks in
    forward order are checkpointed (their inputs kept, the largest one's saves while recomputed); the
    others keep their own saves, as training does (diffpipe.training.checkpointing).

    The blocks are those diffusers hands its checkpointing function: it is switched on for the call
    with a function that runs each block under its own count (recomputing nothing). Storages are told
    apart by address, so every storage seen is held until the end: a freed one's address could be
    reused (layerwise casting replaces the weights' storages at every forward).
    """
    return saved_bytes_each(denoiser, run, [(checkpointing, fraction)])[0]


def saved_bytes_each(denoiser: torch.nn.Module, run, ways: list[tuple[bool, float]]) -> list[tuple[int, int]]:
    """:func:`saved_bytes` for each ``(checkpointing, fraction)`` of ``ways``, from one forward: the forward
    runs the same blocks either way (each through the counting function), so each way counts the same
    saves in the same order, as its own forward would."""
    ways_saves = [_Saves(denoiser, checkpointing=c, partial=c and f < 1) for c, f in ways]
    counts = _Counts(ways_saves)
    blocks = getattr(denoiser, "_supports_gradient_checkpointing", False)
    if blocks:
        denoiser.enable_gradient_checkpointing(gradient_checkpointing_func=counts.run_block)
    try:
        with (torch.autograd.graph.saved_tensors_hooks(counts.pack, lambda t: t), _fused_attention(),
              _meta_autocast_disabled()):
            run()
    finally:
        if blocks:
            denoiser.disable_gradient_checkpointing()
    for saves, (_, fraction) in zip(ways_saves, ways, strict=True):
        if saves.partial:
            saves.checkpoint_first(math.ceil(fraction * len(saves.blocks_seen)))
    return [(sum(st.nbytes() for st in saves.kept.values()), saves.largest) for saves in ways_saves]


_Storages = dict[int, torch.UntypedStorage]


class _Counts:
    """The pack hook and the checkpointing function of one forward, feeding every way's :class:`_Saves`."""

    def __init__(self, ways: list[_Saves]):
        self.ways = ways

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        for saves in self.ways:
            saves.pack(t)
        return t

    def run_block(self, module, *args, **kwargs):
        """The checkpointing function diffusers calls per block: runs it once, each way counting its saves apart."""
        for saves in self.ways:
            saves.enter(args, kwargs)
        out = module(*args, **kwargs)
        for saves in self.ways:
            saves.leave()
        return out


class _Saves:
    """The storages autograd saves during one forward (:func:`saved_bytes`), by address, for one way of
    checkpointing."""

    def __init__(self, denoiser: torch.nn.Module, *, checkpointing: bool, partial: bool):
        # Buffers too: scaled fp8's codes and scales are buffers its matmul saves.
        self.weights: _Storages = {_storage_key(p): p.untyped_storage()
                                   for p in [*denoiser.parameters(), *denoiser.buffers()]}
        self.kept: _Storages = {}  # held until the backward pass
        self.largest = 0  # the largest checkpointed block's own saves (held while it is recomputed)
        self.checkpointing = checkpointing
        self.partial = partial  # only some blocks checkpointed: decided once every block is seen
        self.blocks_seen: list[tuple[_Storages, _Storages]] = []  # (inputs, own saves) per block, in order
        self.running: list[tuple[_Storages, _Storages]] = []  # (inputs, own saves) of the blocks running, innermost last

    def pack(self, t: torch.Tensor) -> None:
        """Record a saved storage that is neither a weight nor kept already: as the innermost running block's
        own save, else as kept."""
        key = _storage_key(t)
        if key not in self.weights and key not in self.kept:
            (self.running[-1][1] if self.running else self.kept)[key] = t.untyped_storage()

    def enter(self, args: tuple, kwargs: dict) -> None:
        """A block starts: under checkpointing, what it receives is kept (all blocks checkpointed)."""
        inputs = self._inputs(args, kwargs) if self.checkpointing else {}
        if self.checkpointing and not self.partial:
            self.kept.update(inputs)
        self.running.append((inputs, {}))

    def leave(self) -> None:
        """The block ended: its own saves counted apart."""
        inputs, inner = self.running.pop()
        if self.partial:
            self.blocks_seen.append((inputs, inner))
        self.largest = max(self.largest, sum(st.nbytes() for st in inner.values()))
        # Checkpointed: held only while recomputed, counted once, as this block's; else kept.
        (self.weights if self.checkpointing else self.kept).update(inner)

    def _inputs(self, args: tuple, kwargs: dict) -> _Storages:
        """What a checkpointed block receives stays referenced by the recomputation until backward."""
        inputs: _Storages = {}
        for arg in [*args, *kwargs.values()]:
            for t in arg if isinstance(arg, (tuple, list)) else (arg,):
                if isinstance(t, torch.Tensor) and _storage_key(t) not in self.weights:
                    inputs[_storage_key(t)] = t.untyped_storage()
        return inputs

    def checkpoint_first(self, chosen: int) -> None:
        """The first ``chosen`` blocks checkpointed (inputs kept), the rest holding their own saves."""
        for i, (inputs, inner) in enumerate(self.blocks_seen):
            self.kept.update(inputs if i < chosen else inner)
        self.largest = max((sum(st.nbytes() for st in inner.values()) for _, inner in self.blocks_seen[:chosen]),
                           default=0)
