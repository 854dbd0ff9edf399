"""Block swap: the frozen weights of the denoiser's blocks live in CPU memory, one block on the GPU at a time.

``train.block_swap: N`` keeps the frozen weights (and buffers) of the last ``N`` repeated blocks (the
elements of the denoiser's top-level ``ModuleList``s: Flux's double and single blocks, Wan's and
Qwen-Image's blocks) in CPU memory. A forward pre-hook puts a block's frozen tensors on the GPU; a
forward hook points them back at the CPU copies (see :class:`BlockSwap` for when). Trainable tensors (the LoRA) never move, so DeepSpeed's
optimizer keeps stepping the tensors it was handed.

Prefetch: while block i computes, the copy of the block that runs next (i+1 in the forward pass, i-1
in the recomputations of the backward pass, which run in reverse) is already under way, so copies
overlap compute. On CUDA the copies run on a side stream from pinned host memory, and the compute
stream waits on an event recorded after each block's copy (:class:`StreamCopier`); on CPU the same
order of copies runs synchronously (:class:`SyncCopier`), so results are identical with or without
swap. The GPU then holds up to two swapped blocks: the one running and the next.

Why activation checkpointing is required: autograd keeps what a layer needs for its backward pass, and a
frozen Linear's backward needs its weight, so without recomputation every block's GPU copy would stay
referenced until the backward pass and swapping would free nothing. With checkpointing a block keeps
only its inputs; its recomputation in the backward pass runs the block's forward again, which fires the
same hooks and brings the weights back for exactly that block's backward.

Why not diffusers' group offloading: it moves every parameter of a group, the trained LoRA included (its
stream mode restores the copies taken at setup, undoing optimizer steps), and DeepSpeed's flattened
optimizer buffers would lose their tensors. Why not DeepSpeed ZeRO-3 parameter offload: it needs ZeRO-3,
fetches every parameter (trainable too) for forward and backward, and its partitioned parameters do not
combine with fp8 layerwise casting.

System RAM: the CPU copies are the swapped blocks' frozen weights at their storage width (pinned on
CUDA, so page-locked: the OS cannot swap them out). The copies are made after DeepSpeed's dtype cast,
from weights already on the GPU, so a GPU run briefly holds them twice: install before filling memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def swap_blocks(denoiser: torch.nn.Module) -> list[torch.nn.Module]:
    """The denoiser's repeated blocks in call order (its top-level ``ModuleList``s, one after the other)."""
    lists = [m for m in denoiser.children() if isinstance(m, torch.nn.ModuleList)]
    return [block for blocks in lists for block in blocks]


def frozen_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter of the module that is not trained, and its buffers."""
    return [p for p in module.parameters() if not p.requires_grad] + list(module.buffers())


#: The host copies of swapped blocks' frozen tensors taken out at load (:func:`hold`), by (id of the module
#: that owns the tensor, its name there): the owners survive PEFT's wrapping, the tensors' names do not.
Held = dict[tuple[int, str], torch.Tensor]


def _frozen_named(block: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    """:func:`frozen_tensors` of ``block`` in the same order, each with its owning module and name."""
    params, buffers = [], []
    for module in block.modules():
        params += [(module, n, p) for n, p in module._parameters.items() if p is not None and not p.requires_grad]
        buffers += [(module, n, b) for n, b in module._buffers.items() if b is not None]
    return params + buffers


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@dataclass
class Copy:
    """A block's device tensors, and (CUDA) the event recorded on the copy stream after they were written."""

    tensors: list[torch.Tensor]
    event: object | None = None


class SyncCopier:
    """Copies on the calling thread, done when :meth:`start` returns (CPU, or any device without streams)."""

    def __init__(self, device: torch.device):
        self.device = device

    def start(self, homes: list[torch.Tensor]) -> Copy:
        # copy=True: on a CPU-only machine the "device" copy is still a fresh tensor, as on a GPU.
        return Copy([h.to(self.device, copy=True) for h in homes])

    def finish(self, copy: Copy) -> list[torch.Tensor]:
        """The tensors, ready for the compute stream."""
        return copy.tensors


class StreamCopier(SyncCopier):
    """CUDA: copies from pinned host memory on a side stream; the compute stream waits on their event."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.stream = torch.cuda.Stream(device)

    def start(self, homes: list[torch.Tensor]) -> Copy:
        # Allocated and written on the side stream; the sources are pinned and never written, so the copy
        # need not wait for the compute stream.
        with torch.cuda.stream(self.stream):
            tensors = [h.to(self.device, non_blocking=True, copy=True) for h in homes]
            event = torch.cuda.Event()
            event.record(self.stream)
        return Copy(tensors, event)

    def finish(self, copy: Copy) -> list[torch.Tensor]:
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(copy.event)
        for t in copy.tensors:
            # Used on the compute stream from now on: the allocator must not hand this memory back to the
            # side stream until the compute stream is done with it.
            t.record_stream(compute)
        return copy.tensors


def copier_for(device: torch.device) -> SyncCopier:
    return StreamCopier(device) if device.type == "cuda" else SyncCopier(device)


class BlockSwap:
    """Hooks that keep the frozen tensors of ``blocks`` in CPU memory except while a block runs.

    In the first forward a checkpointed block saves nothing for backward, so its tensors go back to
    CPU memory as soon as it returns. Its recomputation inside the backward pass does save tensors,
    and autograd saves some parameters themselves (a norm's or a convolution's weight), which would
    see the CPU copy if it were swapped back at once: there the swap back waits until the next block
    is brought in (the backward pass has then finished with this block) or the backward pass ends.

    Prefetch order: a block's pre-hook starts the copy of the block that runs next (the next swapped
    block in the forward pass, the previous one in the backward pass); ``before``, the block that runs
    just before the first swapped one, starts that block's copy; and with gradients on, the last
    swapped block's copy for its recomputation starts as soon as its forward returns (the backward
    pass recomputes it first). At most one copy waits ahead: starting one drops any other.
    """

    def __init__(self, blocks: list[torch.nn.Module], device: torch.device, *,
                 before: torch.nn.Module | None = None, copier: SyncCopier | None = None,
                 held: Held | None = None):
        self.device = device
        self.copier = copier or copier_for(device)
        self.onloads = 0  # how many times a block was brought to the device (tests read it)
        self.prefetched = 0  # of those, how many found their copy already started
        pin = device.type == "cuda"
        self._order = list(blocks)
        self._index = {block: i for i, block in enumerate(self._order)}
        self._home: dict[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._ahead: dict[torch.nn.Module, Copy] = {}  # copies started before their block runs
        self._pending: list[torch.nn.Module] = []  # recomputed blocks still needed by the backward pass
        self._handles = []
        for block in blocks:
            pairs = []
            for module, name, t in _frozen_named(block):
                home = None if held is None else held.pop((id(module), name), None)
                if home is None:
                    home = t.data.to("cpu", copy=True)
                elif home.is_floating_point() and home.dtype != t.dtype:  # as the engine cast the placeholder
                    home = home.to(t.dtype)
                pairs.append((t, home.pin_memory() if pin and not home.is_pinned() else home))
            self._home[block] = pairs
            self._offload(block)
            self._handles.append(block.register_forward_pre_hook(self._pre))
            self._handles.append(block.register_forward_hook(self._post))
        if before is not None and self._order:
            self._handles.append(before.register_forward_pre_hook(self._pre_before))

    @property
    def blocks(self) -> list[torch.nn.Module]:
        """The swapped blocks, in forward order."""
        return list(self._order)

    @property
    def cpu_bytes(self) -> int:
        """System RAM the CPU copies take."""
        return sum(h.nbytes for pairs in self._home.values() for _, h in pairs)

    @torch.compiler.disable()
    def _pre(self, block: torch.nn.Module, args) -> None:
        self._flush()
        backward = _in_backward()
        if backward:
            # A recomputation may stop early, before the block returns (torch's checkpoint stops
            # once it has what the backward pass needs): the swap back cannot wait for _post.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self._pending.append(block)
        copy = self._ahead.pop(block, None)
        self.prefetched += copy is not None
        tensors = self.copier.finish(copy or self.copier.start(self._homes(block)))
        for (t, _), dev in zip(self._home[block], tensors, strict=True):
            t.data = dev
        self.onloads += 1
        i = self._index[block] + (-1 if backward else 1)
        if 0 <= i < len(self._order):
            self._prefetch(self._order[i])

    @torch.compiler.disable()
    def _pre_before(self, module: torch.nn.Module, args) -> None:
        if not _in_backward():
            self._prefetch(self._order[0])

    @torch.compiler.disable()
    def _post(self, block: torch.nn.Module, args, output):
        if not _in_backward():
            self._offload(block)
            if block is self._order[-1] and torch.is_grad_enabled():
                self._prefetch(block)  # the backward pass recomputes the last block first
        return output

    def _prefetch(self, block: torch.nn.Module) -> None:
        if block in self._ahead:
            return
        self._ahead.clear()  # a copy nobody took (the pass went another way) frees its memory
        self._ahead[block] = self.copier.start(self._homes(block))

    def _homes(self, block: torch.nn.Module) -> list[torch.Tensor]:
        return [home for _, home in self._home[block]]

    def _end_backward(self) -> None:
        self._flush()
        self._ahead.clear()  # the last recomputation prefetched a block no backward needs

    def _flush(self) -> None:
        while self._pending:
            self._offload(self._pending.pop())

    def _offload(self, block: torch.nn.Module) -> None:
        for t, home in self._home[block]:
            t.data = home

    def remove(self) -> None:
        """Bring every block back to the device and drop the hooks."""
        for h in self._handles:
            h.remove()
        self._ahead.clear()
        for pairs in self._home.values():
            for t, home in pairs:
                t.data = home.to(self.device)
        self._handles, self._home = [], {}


def swapped(denoiser: torch.nn.Module, n_blocks: int) -> list[torch.nn.Module]:
    """The blocks ``block_swap: n_blocks`` swaps: the last ``n_blocks`` repeated blocks (all if fewer); a
    clear error for a denoiser without repeated transformer blocks."""
    blocks = swap_blocks(denoiser)
    repeated = set(getattr(denoiser, "_repeated_blocks", None) or ())
    if not blocks or any(type(b).__name__ not in repeated for b in blocks):
        # Only where diffusers checkpoints exactly these blocks does a recomputation bring them back
        # (the SD UNets checkpoint each resnet and attention inside their blocks).
        raise ValueError(f"train.block_swap: {type(denoiser).__name__} has no repeated transformer blocks to "
                         "swap (supported: transformer denoisers such as Flux, Qwen-Image, Wan)")
    return blocks[-min(n_blocks, len(blocks)):]


def hold(denoiser: torch.nn.Module, n_blocks: int, device: torch.device) -> Held | None:
    """Take the frozen-to-be tensors (every parameter and buffer) of the blocks ``block_swap`` will swap out of
    the model before the engine is built, so neither the engine's move nor its cast puts them on the GPU:
    each keeps its host data (the streamed load put it there) as its home and holds an empty placeholder of its
    dtype on ``device`` (PEFT places a LoRA by it). :func:`install` puts the homes back. None when
    ``n_blocks`` is 0."""
    if not n_blocks:
        return None
    held: Held = {}
    for block in swapped(denoiser, n_blocks):
        for module in block.modules():
            for name, t in [*module._parameters.items(), *module._buffers.items()]:
                if t is not None:
                    held[(id(module), name)] = t.data
                    t.data = torch.empty(0, dtype=t.dtype, device=device)
    return held


def install(denoiser: torch.nn.Module, n_blocks: int, device: torch.device, *,
            copier: SyncCopier | None = None, held: Held | None = None) -> BlockSwap | None:
    """Swap the last ``n_blocks`` blocks of ``denoiser`` (all of them if fewer); None when ``n_blocks`` is 0.

    Call after DeepSpeed built its engine: it moves and casts the module, which would pull the CPU
    copies back. ``copier``: how copies are made (default: a side CUDA stream on CUDA, in place on CPU).
    ``held``: the homes :func:`hold` kept since the load (none: copied from the blocks' tensors now).
    """
    if not n_blocks:
        return None
    blocks = swapped(denoiser, n_blocks)
    n = len(blocks)
    everything = swap_blocks(denoiser)
    before = everything[-n - 1] if n < len(everything) else None
    return BlockSwap(blocks, device, before=before, copier=copier, held=held)
