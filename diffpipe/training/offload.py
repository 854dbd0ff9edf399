"""Block swap: the frozen weights of the denoiser's blocks live in CPU memory, one block on the GPU at a time.

``train.block_swap: N`` keeps the frozen weights (and buffers) of the last ``N`` repeated blocks (the
elements of the denoiser's top-level ``ModuleList``s: Flux's double and single blocks, Wan's and
Qwen-Image's blocks) in CPU memory. A forward pre-hook copies a block's frozen tensors to the GPU; a
forward hook points them back at the CPU copies (see :class:`BlockSwap` for when). Trainable tensors (the LoRA) never move, so DeepSpeed's
optimizer keeps stepping the tensors it was handed.

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

import torch


def swap_blocks(denoiser: torch.nn.Module) -> list[torch.nn.Module]:
    """The denoiser's repeated blocks in call order (its top-level ``ModuleList``s, one after the other)."""
    lists = [m for m in denoiser.children() if isinstance(m, torch.nn.ModuleList)]
    return [block for blocks in lists for block in blocks]


def frozen_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter of the module that is not trained, and its buffers."""
    return [p for p in module.parameters() if not p.requires_grad] + list(module.buffers())


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class BlockSwap:
    """Hooks that keep the frozen tensors of ``blocks`` in CPU memory except while a block runs.

    In the first forward a checkpointed block saves nothing for backward, so its tensors go back to
    CPU memory as soon as it returns. Its recomputation inside the backward pass does save tensors,
    and autograd saves some parameters themselves (a norm's or a convolution's weight), which would
    see the CPU copy if it were swapped back at once: there the swap back waits until the next block
    is brought in (the backward pass has then finished with this block) or the backward pass ends.
    """

    def __init__(self, blocks: list[torch.nn.Module], device: torch.device):
        self.device = device
        self.onloads = 0  # how many times a block was brought to the device (tests read it)
        pin = device.type == "cuda"
        self._home: dict[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._pending: list[torch.nn.Module] = []  # recomputed blocks still needed by the backward pass
        self._handles = []
        for block in blocks:
            pairs = []
            for t in frozen_tensors(block):
                home = t.data.to("cpu", copy=True)
                pairs.append((t, home.pin_memory() if pin else home))
            self._home[block] = pairs
            self._offload(block)
            self._handles.append(block.register_forward_pre_hook(self._pre))
            self._handles.append(block.register_forward_hook(self._post))

    @property
    def cpu_bytes(self) -> int:
        """System RAM the CPU copies take."""
        return sum(h.nbytes for pairs in self._home.values() for _, h in pairs)

    @torch.compiler.disable()
    def _pre(self, block: torch.nn.Module, args) -> None:
        self._flush()
        if _in_backward():
            # A recomputation may stop early, before the block returns (torch's checkpoint stops
            # once it has what the backward pass needs): the swap back cannot wait for _post.
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)
            self._pending.append(block)
        # copy=True: on a CPU-only machine the "device" copy is still a fresh tensor, as on a GPU.
        for t, home in self._home[block]:
            t.data = home.to(self.device, non_blocking=True, copy=True)
        self.onloads += 1

    @torch.compiler.disable()
    def _post(self, block: torch.nn.Module, args, output):
        if not _in_backward():
            self._offload(block)
        return output

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
        for pairs in self._home.values():
            for t, home in pairs:
                t.data = home.to(self.device)
        self._handles, self._home = [], {}


def install(denoiser: torch.nn.Module, n_blocks: int, device: torch.device) -> BlockSwap | None:
    """Swap the last ``n_blocks`` blocks of ``denoiser`` (all of them if fewer); None when ``n_blocks`` is 0.

    Call after DeepSpeed built its engine: it moves and casts the module, which would pull the CPU
    copies back.
    """
    if not n_blocks:
        return None
    blocks = swap_blocks(denoiser)
    repeated = set(getattr(denoiser, "_repeated_blocks", None) or ())
    if not blocks or any(type(b).__name__ not in repeated for b in blocks):
        # Only where diffusers checkpoints exactly these blocks does a recomputation bring them back
        # (the SD UNets checkpoint each resnet and attention inside their blocks).
        raise ValueError(f"train.block_swap: {type(denoiser).__name__} has no repeated transformer blocks to "
                         "swap (supported: transformer denoisers such as Flux, Qwen-Image, Wan)")
    return BlockSwap(blocks[-n_blocks:], device)
