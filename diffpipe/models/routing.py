"""Token routing (``train.token_routing``): during training, a random share of the image (or video) tokens
skips a run of the denoiser's blocks and rejoins after them, so those blocks compute on fewer tokens.

A family declares its block stack (:class:`RoutedStack`: the names of the block lists, in forward order,
and how its per-token block arguments, the rotary embedding first, are indexed); this module does the
rest. The router wraps the ``forward`` of each routed block of the diffusers transformer in place (the
blocks stay the same objects, so LoRA, activation checkpointing, block swap and DeepSpeed's hooks see
them as before):

- the first routed block takes the kept tokens ``hidden[:, kept]`` (the same ``kept`` for every sample of
  the batch, so a rotary embedding shared by the batch is gathered once);
- every routed block gets its per-token arguments gathered alike (the positional embedding travels with
  its tokens);
- the last routed block's output is scattered back into the hidden states as they entered the first:
  the skipped tokens come out unchanged, the kept ones as the blocks left them.

Routing happens only inside :func:`routed` (a training step's prediction); any other forward (evaluation,
sampling, output preservation's base prediction) runs every token. A forward under routing keeps its
kept tokens until the transformer's next forward, because activation checkpointing recomputes the blocks
during the backward pass and must see the same tokens.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import ModelMixin

from diffpipe.config.base import ConfigError

#: Gathers a routed block's per-token arguments (bound by name) for the kept image tokens ``kept``.
Gather = Callable[[dict[str, Any], torch.Tensor], None]


@dataclass(frozen=True)
class RoutedStack:
    """A family's homogeneous block stack, as token routing needs it."""

    #: Attributes of the transformer holding its block lists, in forward order; routed block indices count
    #: over their concatenation (FLUX.1: the 19 double-stream blocks, then the 38 single-stream ones).
    lists: tuple[str, ...]
    #: Gathers the per-token arguments other than ``hidden_states`` in place (the rotary embedding).
    gather: Gather
    #: Where the image tokens are in a block's output: an index into its output tuple, or None when the
    #: block returns the hidden states alone.
    output: int | None = 1


@dataclass(frozen=True)
class TokenRoute:
    """One training forward's routing: blocks ``start <= i < end`` see ``keep`` of the image tokens, chosen by
    ``generator`` (seeded from the step, so a resumed run routes the same tokens)."""

    keep: float
    start: int
    end: int
    generator: torch.Generator

    def kept(self, tokens: int, device: torch.device) -> torch.Tensor:
        """``round(keep * tokens)`` (at least one) token indices, ascending, drawn from the generator."""
        count = max(1, min(tokens, round(self.keep * tokens)))
        return torch.randperm(tokens, generator=self.generator)[:count].sort().values.to(device)


def route_generator(seed: int, step: int, rank: int, micro: int) -> torch.Generator:
    """The routing draws of one micro-batch: a function of the run's seed, the step, the data-parallel rank
    and the micro-batch, so resuming at a step routes as the uninterrupted run did."""
    return torch.Generator().manual_seed(((seed * 1_000_003 + step) * 4099 + rank) * 257 + micro)


def gather_tokens(t: torch.Tensor, kept: torch.Tensor, dim: int, offset: int = 0) -> torch.Tensor:
    """``t``'s entries along ``dim`` of the kept image tokens, after ``offset`` leading (text) entries kept whole."""
    if offset == 0:
        return t.index_select(dim, kept)
    return torch.cat((t.narrow(dim, 0, offset), t.index_select(dim, kept + offset)), dim=dim)


class _State:
    """What the routed blocks of one transformer share: the armed route and this forward's draw."""

    def __init__(self) -> None:
        self.armed: TokenRoute | None = None  # set by :func:`routed`
        self.route: TokenRoute | None = None  # the current forward's (kept until the next forward)
        self.kept: torch.Tensor | None = None
        self.full: torch.Tensor | None = None  # the hidden states entering the first routed block

    def begin(self, *_: Any) -> None:
        """Forward pre-hook of the transformer: a new forward routes only when armed, with a fresh draw."""
        self.route, self.kept, self.full = self.armed, None, None


class _Router:
    """Installed once per transformer: wraps its blocks' ``forward`` (inert unless a route is armed)."""

    def __init__(self, transformer: torch.nn.Module, stack: RoutedStack):
        self.stack, self.state = stack, _State()
        self.blocks = [b for name in stack.lists for b in getattr(transformer, name)]
        self.installed: dict[int, tuple[bool, bool]] = {}  # block index -> (first, last) it was wrapped as
        transformer.register_forward_pre_hook(self.state.begin)

    def cover(self, start: int, end: int) -> None:
        """Wrap blocks ``start..end-1`` (once per run: a run routes one range)."""
        if not 0 <= start < end <= len(self.blocks):
            raise ConfigError(f"train.token_routing: blocks {start}..{end - 1} (start_block {start}, end_block "
                              f"{end}) are not within this denoiser's {len(self.blocks)} blocks; set "
                              f"0 <= start_block < end_block <= {len(self.blocks)}")
        wanted = {i: (i == start, i == end - 1) for i in range(start, end)}
        if self.installed and self.installed != wanted:
            raise ValueError("train.token_routing: one denoiser routes one block range per run")
        if not self.installed:
            for i, (first, last) in wanted.items():
                self._wrap(self.blocks[i], first, last)
            self.installed = wanted

    def _wrap(self, block: torch.nn.Module, first: bool, last: bool) -> None:
        inner = block.forward  # bound: the class's forward, or what another wrapper installed
        signature = inspect.signature(inner)
        state, stack = self.state, self.stack

        def forward(*args: Any, **kwargs: Any) -> Any:
            if state.route is None:
                return inner(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            a = bound.arguments
            if first:  # also when checkpointing recomputes it: the same kept tokens (drawn once per forward)
                state.full = a["hidden_states"]
                if state.kept is None:
                    state.kept = state.route.kept(state.full.shape[1], state.full.device)
                a["hidden_states"] = state.full.index_select(1, state.kept)
            stack.gather(a, state.kept)
            out = inner(*bound.args, **bound.kwargs)
            return _rejoin(out, stack.output, state) if last else out

        block.forward = forward


def _rejoin(out: Any, where: int | None, state: _State) -> Any:
    """The last routed block's output with its tokens scattered back among the skipped ones."""
    routed = out if where is None else out[where]
    merged = state.full.index_copy(1, state.kept, routed.to(state.full.dtype))
    if where is None:
        return merged
    return (*out[:where], merged, *out[where + 1:])


def _transformers(denoiser: torch.nn.Module, stack: RoutedStack) -> list[torch.nn.Module]:
    """The diffusers transformers inside ``denoiser`` (a DeepSpeed engine, a wrapper beside trained text
    encoders, two experts) that hold the declared block lists."""
    found = [m for m in denoiser.modules() if isinstance(m, ModelMixin)
             and all(isinstance(getattr(m, n, None), torch.nn.ModuleList) for n in stack.lists)]
    if not found:
        raise ValueError(f"token routing: no transformer with block lists {', '.join(stack.lists)} in "
                         f"{type(denoiser).__name__}")
    return found


def install(denoiser: torch.nn.Module, stack: RoutedStack, start: int, end: int) -> list[_State]:
    """Routers on the transformers in ``denoiser`` covering blocks ``start..end-1``; their states."""
    states = []
    for tr in _transformers(denoiser, stack):
        router = tr.__dict__.get("_diffpipe_router")
        if router is None:
            router = _Router(tr, stack)
            tr.__dict__["_diffpipe_router"] = router  # not a submodule: no state-dict entry, no hooks
        router.cover(start, end)
        states.append(router.state)
    return states


@contextmanager
def routed(denoiser: torch.nn.Module, stack: RoutedStack | None, route: TokenRoute | None) -> Iterator[None]:
    """Forwards of ``denoiser`` inside route ``route``'s share of the tokens (None: no routing)."""
    if route is None or route.keep >= 1:
        yield
        return
    if stack is None:
        raise ConfigError("train.token_routing: this model family declares no homogeneous block stack")
    states = install(denoiser, stack, route.start, route.end)
    for s in states:
        s.armed = route
    try:
        yield
    finally:
        for s in states:
            s.armed = None
