"""The denoiser as training loads it: read tensor by tensor, its frozen Linears quantised and each module
placed as it is read (:mod:`diffpipe.models.streaming`), where the model allows it.

A plain diffusers folder of safetensors files streams. With ``train.base_weights`` fp8, int8 or nf4 (and a
plain LoRA, ``train.lora.kind: lora``) each layer that :func:`~diffpipe.training.precision.quantised_layers`
would pick once the LoRA is in is quantised the moment its weight is read, so system RAM holds the
quantised model plus one layer at its load dtype, never the whole model at it. Each module's tensors then go
where they will live: resident ones to the training device, the blocks ``train.block_swap`` swaps to
pinned host memory (CUDA; on a CPU machine every tensor is already where it lives). The result is the
same model, tensor for tensor and dtype for dtype, as loading whole and quantising after the LoRA
(tests/unit/test_streamed_load.py).

What does not stream is loaded whole, as before, and the log says why: the tiny flavor (built in memory),
a single-file checkpoint (diffusers' converters take the whole state dict), ``.bin`` weights, and families
that build their denoiser their own way (Wan 2.2's two experts trained together, FLUX Control's widened
input, Kandinsky 5, ERNIE-Image: ``Family.streamed_denoiser`` is None for them). DoRA, LoKr and LoHa stream at the load dtype and are quantised after the LoRA, as before:
DoRA's magnitude is computed from the unquantised weight.

Base LoRAs (``model.base_loras``, :mod:`diffpipe.training.base_loras`) are folded into each weight as it
arrives, in its load dtype and before it is quantised; into a model loaded whole, module by module after.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from peft.tuners.tuners_utils import check_target_module_exists

from diffpipe.config import TrainConfig
from diffpipe.models import _common as common
from diffpipe.models import streaming
from diffpipe.training import adapter, offload, precision
from diffpipe.training.base_loras import BaseDeltas


@dataclass
class LoadedDenoiser:
    """The denoiser, whether it was streamed, whether ``base_weights`` is already applied, and a log line."""

    module: torch.nn.Module
    streamed: bool
    quantised: bool
    note: str


def why_whole(family: Any) -> str | None:
    """Why ``diffpipe train`` loads this denoiser whole (None: it streams)."""
    source = family.streamed_denoiser()
    if source is None:
        return f"family {family.name!r} builds its denoiser its own way"
    return streaming.why_not_streamed(family.cfg, source[1])


def streams(family: Any, tc: TrainConfig) -> bool:
    """Whether the load streams (and, with 8- or 4-bit base weights, quantises as it reads) once the model is
    a local diffusers folder: the tiny flavor and a hub id count as one (the estimate sizes published models).
    DoRA, LoKr and LoHa quantise after the LoRA, so the whole model is in RAM at its load dtype first."""
    source = family.streamed_denoiser()
    if source is None or family.cfg.single_files.get(source[1]):
        return False
    return tc.base_weights == "auto" or quantised_at_load(tc)


def quantised_at_load(tc: TrainConfig) -> bool:
    """Whether a streamed load quantises as it reads (plain LoRA with 8- or 4-bit base weights)."""
    return tc.base_weights != "auto" and tc.mode == "lora" and tc.lora.kind == "lora"


def layers_to_quantise(model: torch.nn.Module, kind: str, lora: Any) -> set[str]:
    """The Linears of the LoRA-less ``model`` that :func:`~diffpipe.training.precision.quantised_layers`
    picks once the PEFT config ``lora`` is in: a wrapped layer is seen there as ``<name>.base_layer``."""
    out = set()
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            seen = f"{name}.base_layer" if check_target_module_exists(lora, name) else name
            if precision.quantisable(seen, m, kind):
                out.add(name)
    return out


def swapped_prefixes(model: torch.nn.Module, n_blocks: int) -> tuple[str, ...]:
    """Module-name prefixes (``"single_transformer_blocks.3."``) of the blocks ``block_swap`` keeps in host
    memory: the last ``n_blocks`` of :func:`~diffpipe.training.offload.swap_blocks`."""
    if not n_blocks:
        return ()
    names = {id(m): n for n, m in model.named_modules()}
    blocks = offload.swap_blocks(model)
    return tuple(f"{names[id(b)]}." for b in blocks[len(blocks) - min(n_blocks, len(blocks)):])


def _move_own(module: torch.nn.Module, move: Any) -> None:
    """Move a module's own tensors (not its children's, which may still be on ``meta``)."""
    for key, p in module._parameters.items():
        if p is not None:
            module._parameters[key] = type(p)(move(p.detach()), requires_grad=p.requires_grad)
    for key, b in module._buffers.items():
        if b is not None:
            module._buffers[key] = move(b)


def _hooks(model: torch.nn.Module, tc: TrainConfig, family: Any, device: torch.device, dtype: torch.dtype,
           base: BaseDeltas | None = None):
    names: set[str] = set()
    if quantised_at_load(tc):
        lora = adapter.peft_config(tc.lora, family.lora_targets(tc.lora.targets))
        names = layers_to_quantise(model, tc.base_weights, lora)
    compute = precision.compute_dtype(tc)
    swapped = swapped_prefixes(model, tc.block_swap)

    def finish(name: str, module: torch.nn.Module) -> None:
        if base is not None:  # base LoRAs go into the weight in its load dtype, before it is quantised
            base.fold(name, module)
        if name in names:
            precision.quantise_layer(module, tc.base_weights, compute)
            # PEFT puts a LoRA in its base layer's dtype (or this attribute's): the load dtype, as when the
            # LoRA goes in before quantisation.
            module.compute_dtype = dtype

    def place(name: str, module: torch.nn.Module) -> None:
        if device.type == "cpu":
            return
        if f"{name}.".startswith(swapped) and name:
            _move_own(module, lambda t: t.pin_memory() if device.type == "cuda" else t)
        else:
            _move_own(module, lambda t: t.to(device))

    return finish, place


def load_denoiser(family: Any, tc: TrainConfig, device: torch.device, base: BaseDeltas | None = None,
                  ) -> LoadedDenoiser:
    """The family's denoiser for training under ``tc`` on ``device`` (module docstring), with the base LoRAs
    ``base`` folded into its weights (``model.base_loras``)."""
    reason = why_whole(family)
    if reason is not None:
        model = family.load_denoiser()
        if base is not None:
            base.fold_all(model)
        return LoadedDenoiser(model, False, False, f"loaded whole ({reason})")
    cls, subfolder = family.streamed_denoiser()
    dtype = common.load_dtype(family.cfg, "denoiser")
    if tc.base_weights != "auto" and not quantised_at_load(tc):
        device = torch.device("cpu")  # quantised after the LoRA, in host memory, as a whole load is
    model = streaming.stream_component(cls, family.cfg, subfolder, dtype,
                                       hooks=lambda m: _hooks(m, tc, family, device, dtype, base))
    if base is not None:
        base.check()
    quantised = quantised_at_load(tc)
    what = f"{tc.base_weights} base weights quantised as read" if quantised else f"in {dtype}"
    return LoadedDenoiser(model, True, quantised, f"streamed tensor by tensor ({what})")


@contextmanager
def quiet_lora() -> Iterator[None]:
    """PEFT wraps a Linear whose weight is already torchao's int8 (quantised as read) in its torchao LoRA
    layer and warns that it cannot merge; training never merges (export reloads the base), so the warning
    is kept out of the log."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TorchaoLoraLinear was instantiated")
        yield


#: Transient bytes of reading one tensor, in units of the largest tensor at its load width: the bytes read,
#: the cast copy, the stored result and quantisation's temporaries (NF4's from_tensor holds several float
#: copies). Measured by benchmarks/load_peak.py at FLUX.1's width.
FLIGHT = {"auto": 1, "fp8": 3, "int8": 3, "nf4": 4}


@dataclass(frozen=True)
class LoadPeak:
    """Peak bytes while the denoiser loads, beyond the process's own: system RAM and GPU memory."""

    ram: int
    gpu: int


def load_peak(*, stored: int, whole: int, swapped: int, largest: int, kind: str, streamed: bool,
              on_cpu: bool = False) -> LoadPeak:
    """The load's peak from the frozen weights as ``stored`` (quantised, all blocks), the ``whole`` model at
    its load dtype, the ``swapped`` blocks' stored bytes and the ``largest`` tensor at its load dtype.

    Streamed: RAM holds the swapped blocks and one tensor in flight; the GPU the rest as stored. Loaded whole:
    RAM holds the whole model at its load dtype (the pages of the mapped file) and, when quantised, the stored
    model beside it (an upper bound: the unquantised tensors are counted twice), then the GPU receives every
    block as stored (the swapped ones too, until the swap copies them out). ``on_cpu``: the device is the CPU
    (no GPU), so everything is RAM; loaded whole, the swap's copies then come on top of the stored model."""
    flight = FLIGHT[kind] * largest
    whole_ram = whole + flight + (stored if kind != "auto" else 0)
    if on_cpu:
        return LoadPeak(stored + flight if streamed else max(whole_ram, stored + swapped), 0)
    if streamed:
        return LoadPeak(swapped + flight, stored - swapped)
    return LoadPeak(whole_ram, stored)


def stored_bytes(model: torch.nn.Module, kind: str, names: set[str], width: int, compute: int,
                 within: tuple[str, ...] = ("",)) -> int:
    """Bytes of ``model``'s (LoRA-less; on ``meta`` is enough) tensors under the module-name prefixes
    ``within`` as ``base_weights: kind`` stores them: the Linears ``names`` at their quantised size
    (nf4 from ``compute``-byte weights), every other tensor at ``width`` bytes."""
    total = 0
    for name, m in model.named_modules():
        if not f"{name}.".startswith(within):
            continue
        total += sum(t.numel() for t in [*m._parameters.values(), *m._buffers.values()] if t is not None) * width
        if name in names:
            w = m.weight
            size = {"fp8": w.numel() + 2 * w.shape[0], "int8": w.numel() + 4 * w.shape[0]}.get(kind)
            total += (size if size is not None else precision.nf4_bytes(w.numel(), compute)) - w.numel() * width
    return total


def estimate_peak(family: Any, tc: TrainConfig, *, device: torch.device, streamed: bool | None = None) -> LoadPeak:
    """:func:`load_peak` for ``family``'s denoiser config (built on ``meta``) under ``tc`` on ``device``;
    ``streamed`` None: as :func:`load_denoiser` would load it."""
    cls, subfolder = family.streamed_denoiser()
    width = common.load_dtype(family.cfg, "denoiser", cuda=device.type == "cuda").itemsize
    with torch.device("meta"):
        model = cls.from_config(cls.load_config(family.cfg.path, subfolder=subfolder))
    lora = adapter.peft_config(tc.lora, family.lora_targets(tc.lora.targets))
    names = layers_to_quantise(model, tc.base_weights, lora) if tc.base_weights != "auto" else set()
    sizes = (tc.base_weights, names, width, precision.compute_dtype(tc).itemsize)
    stored = stored_bytes(model, *sizes)
    swapped = stored_bytes(model, *sizes, within=swapped_prefixes(model, tc.block_swap)) if tc.block_swap else 0
    whole = sum(t.numel() for t in model.parameters()) * width
    largest = max(t.numel() for t in model.parameters()) * width
    if streamed is None:
        streamed = why_whole(family) is None and streams(family, tc)
    return load_peak(stored=stored, whole=whole, swapped=swapped, largest=largest, kind=tc.base_weights,
                     streamed=streamed, on_cpu=device.type == "cpu")
