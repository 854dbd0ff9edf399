"""Model FLOPs per training step, TFLOPS per device and MFU (model FLOPs utilisation).

The FLOPs of a step are counted with torch's own FLOP formulas
(``torch.utils.flop_counter``'s registry, as ``FlopCounterMode`` uses them) around the real forward and
backward of the first step of each batch shape (buckets and micro-batch size),
LoRA or full fine-tuning alike; later steps of that shape reuse the count, so
counting costs one slower step per shape. The counter sees matrix products,
convolutions and attention kernels (where the work is), not element-wise ops
or the optimizer. With activation checkpointing the recomputed forward is
counted too: the figure is the work the device did, not the model's minimum.

MFU = TFLOPS per device / the device's dense peak at the training precision,
from ``PEAK_TFLOPS`` (vendor data sheets, without sparsity) or
``train.peak_tflops``. fp32 on CUDA uses the TF32 peak: training enables TF32
matmuls (diffpipe.training.precision). No peak is known for CPUs.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop, sdpa_flop

from diffpipe.config import TrainConfig
from diffpipe.training.precision import resolve_precision

#: Dense peak TFLOPS (no sparsity) by a name fragment of ``torch.cuda.get_device_name``; first match wins,
#: so more specific names come first. From the vendors' data sheets.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0},
    "H100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},  # SXM
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "GH200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "A800": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6},
    "L40": {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 35.0},
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "A6000": {"bf16": 154.8, "fp16": 154.8, "tf32": 77.4, "fp32": 38.7},  # RTX A6000
    "RTX 6000 Ada": {"bf16": 364.2, "fp16": 364.2, "tf32": 182.1, "fp32": 91.1},
    "RTX 4090": {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6},
    "RTX 3090": {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6},
    "V100": {"fp16": 125.0, "fp32": 15.7, "tf32": 15.7},
    "T4": {"fp16": 65.0, "fp32": 8.1, "tf32": 8.1},
    "MI300X": {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4},
    "MI250X": {"bf16": 383.0, "fp16": 383.0, "fp32": 95.7, "tf32": 95.7},
}


def device_peak_tflops(device: torch.device, precision: str) -> float | None:
    """The dense peak of ``device`` at ``precision`` (``fp32``, ``bf16``, ``fp16``), or None if unknown."""
    if device.type != "cuda":
        return None
    key = "tf32" if precision == "fp32" and torch.backends.cuda.matmul.allow_tf32 else precision
    return peak_for_name(torch.cuda.get_device_name(device), key)


def peak_for_name(name: str, precision: str) -> float | None:
    """``PEAK_TFLOPS`` of the first entry whose key occurs in the device ``name``."""
    for fragment, peaks in PEAK_TFLOPS.items():
        if fragment.lower() in name.lower():
            return peaks.get(precision)
    return None


_aten = torch.ops.aten
#: torch's counter knows the CUDA attention kernels; CPU's fused attention has the same arguments and work.
#: (torch exports the formulas already wrapped to take shapes.)
_FORMULAS = {
    **flop_registry,
    _aten._scaled_dot_product_flash_attention_for_cpu: sdpa_flop,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: sdpa_backward_flop,
}


class _Counter(TorchDispatchMode):
    """Sums torch's FLOP formulas over the ops that run inside.

    Not ``FlopCounterMode`` itself: its per-module breakdown hooks every module's
    backward, which reorders gradient sums and so changes the trained weights in
    the last bits; counting must leave training bit for bit as it is.
    """

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = _FORMULAS.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out

    def get_total_flops(self) -> int:
        return self.total


@contextmanager
def counted() -> Iterator[_Counter]:
    """Count the FLOPs of what runs inside (forward and backward); ``get_total_flops()`` after."""
    with _Counter() as mode:
        yield mode


class StepFlops:
    """FLOPs per optimizer step, counted once per batch shape; the metric fields of each step."""

    def __init__(self, tc: TrainConfig, device: torch.device):
        self.enabled = tc.count_flops
        self.peak = tc.peak_tflops or device_peak_tflops(device, resolve_precision(tc.precision))
        self._by_shape: dict[Hashable, int] = {}
        self._current: int | None = None

    @contextmanager
    def step(self, shape: Hashable) -> Iterator[None]:
        """Wrap one optimizer step of batches of ``shape`` (counted the first time that shape trains)."""
        if not self.enabled or shape in self._by_shape:
            self._current = self._by_shape.get(shape)
            yield
            return
        with counted() as mode:
            yield
        self._current = self._by_shape[shape] = mode.get_total_flops()

    def fields(self, step_time: float) -> dict[str, float]:
        """``flops_per_step``, ``tflops_per_device`` and (peak known) ``mfu`` of the last step."""
        if self._current is None or step_time <= 0:
            return {}
        tflops = self._current / step_time / 1e12
        out = {"flops_per_step": float(self._current), "tflops_per_device": tflops}
        if self.peak:
            out["mfu"] = tflops / self.peak
        return out
