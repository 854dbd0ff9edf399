"""Precision and speed settings of a training run, applied to the denoiser in one place.

``train.precision: auto`` is bf16 on CUDA and fp32 on CPU (DeepSpeed on CPU runs bf16 and fp32, not
fp16). Under bf16 DeepSpeed casts the module's parameters to bf16 and its optimizer wrapper keeps
float32 master copies of the trained ones (``FP16_Optimizer`` with bf16 at ZeRO 0, the ZeRO
optimizers' float32 partitions above), so the LoRA is stepped in float32.

``train.base_weights: fp8`` stores the frozen Linear weights as scaled float8_e4m3fn: a scale per output
channel (the row's largest magnitude over e4m3's 448, rounded up to a bfloat16 value, so any later cast of
it is exact) maps each row onto fp8's full range, so small weights keep their 3 mantissa bits instead of
falling into fp8's subnormals as a plain cast lets them. Each matmul dequantises its layer to the compute
dtype (:class:`ScaledFp8Linear`); the autograd function saves the 1-byte codes, not a 16-bit copy, and
dequantises again for the backward. Codes and scales are non-persistent buffers held as integer views
(uint8, uint16): frozen, out of the optimizer and of checkpoints, and left alone by module-wide dtype casts
(DeepSpeed's bf16 mode casts the whole module). The layers are those diffusers' layerwise casting would
cast (:func:`quantised_layers`): norms and AdaLN modulation Linears (named ``norm*``), positional and patch
embeddings, ``proj_in``/``proj_out``, convolutions and PEFT's LoRA layers stay in 16/32 bits.

``train.base_weights: int8`` quantises the same Linear layers with torchao (int8 weights, a float scale
per output channel, dequantised inside each matmul), on CPU and GPU alike. ``nf4`` stores them as QLoRA's
4-bit NormalFloat (torchao's ``NF4Tensor``: a 4-bit code per weight, an absmax scale per 64 weights, those
scales themselves quantised to int8 in groups of 256), dequantised for each matmul in plain PyTorch, so it
runs on CPU too; its autograd function saves the 4-bit weight, not a dequantised copy, for the backward.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN
from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements

from diffpipe.config import BF16_OPTIMIZERS, QUANTISED_OPTIMIZERS, TrainConfig
from diffpipe.models._common import cuda_defaults
from diffpipe.models.casting import FP8_MAX, FP8_SKIPPED_CLASSES, ScaledFp8Linear, dequantise_fp8  # noqa: F401
from diffpipe.models.comfy_fp8 import require_fp8_base

# ScaledFp8Linear and its helpers (imported above) live with the shared model machinery, since the fp8-scaled
# file loader builds the layer too; they keep their names here for the callers that use them from this module.
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: Backends that run without CUDA (torch SDPA and its math kernel; flex attention).
_CPU_BACKENDS = {"native", "_native_math", "flex"}


def resolve_precision(precision: str, cuda: bool | None = None) -> str:
    """``auto`` -> ``bf16`` on CUDA, ``fp32`` on CPU; other values as they are."""
    if precision != "auto":
        return precision
    cuda = torch.cuda.is_available() if cuda is None else cuda
    return "bf16" if cuda else "fp32"


def compute_dtype(tc: TrainConfig) -> torch.dtype:
    """The dtype the denoiser computes in during training."""
    return _DTYPES[resolve_precision(tc.precision)]


def check(tc: TrainConfig) -> None:
    """Refuse, before anything loads, settings this machine cannot run (errors name the key)."""
    cuda = torch.cuda.is_available()
    if resolve_precision(tc.precision) == "fp16" and not cuda:
        raise ValueError("train.precision fp16 needs a CUDA GPU (CPU kernels lack fp16); use bf16 or fp32")
    if tc.optimizer in BF16_OPTIMIZERS and resolve_precision(tc.precision) != "bf16":
        raise ValueError(f"train.optimizer {tc.optimizer} rounds updates into bf16 weights; train.precision "
                         f"{tc.precision} resolves to {resolve_precision(tc.precision)} here: set precision: bf16 "
                         "(or use adamw)")
    if (tc.optimizer_in_backward and resolve_precision(tc.precision) == "bf16"
            and tc.optimizer not in (*QUANTISED_OPTIMIZERS, *BF16_OPTIMIZERS)):
        raise ValueError(f"train.optimizer_in_backward under bf16 (train.precision {tc.precision} here) steps the "
                         f"bf16 weights themselves, where train.optimizer {tc.optimizer} rounds small updates away: "
                         "use adamw8bit, adamw4bit, adamw_kahan or adamw_stochastic (or precision: fp32)")
    backend = tc.attention_backend.lower()
    known = sorted(b.value for b in AttentionBackendName)
    if backend not in known:
        raise ValueError(f"train.attention_backend {tc.attention_backend!r}: not a diffusers attention backend; "
                         f"known: {', '.join(known)}")
    if backend not in _CPU_BACKENDS and not cuda:
        raise ValueError(f"train.attention_backend {backend!r} needs a CUDA GPU; on CPU use native")
    if backend != "native":
        try:
            _check_attention_backend_requirements(AttentionBackendName(backend))
        except (RuntimeError, ImportError) as err:
            raise ValueError(f"train.attention_backend {backend!r} cannot run here: {err}") from err


def prepare_denoiser(denoiser: torch.nn.Module, tc: TrainConfig, *, quantise: bool = True) -> torch.nn.Module:
    """Apply ``base_weights`` (unless ``quantise`` is False: a streamed load quantised as it read,
    :mod:`diffpipe.training.load`), ``attention_backend`` and ``compile`` (after the LoRA is added);
    the CUDA defaults (:func:`~diffpipe.models._common.cuda_defaults`). Returns the denoiser (the same module)."""
    cuda_defaults()
    require_fp8_base(denoiser, tc.base_weights)  # a denoiser loaded from an fp8-scaled file
    if not quantise:
        pass
    elif tc.base_weights == "fp8":
        enable_fp8_base_weights(denoiser)
    elif tc.base_weights in QUANTISED:
        enable_quantised_base_weights(denoiser, compute_dtype(tc), tc.base_weights)
    if tc.attention_backend.lower() != "native":
        denoiser.set_attention_backend(tc.attention_backend.lower())
    if tc.compile:
        compile_blocks(denoiser)
    return denoiser


def scaled_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)`` of a 2-D weight: per row, the largest magnitude over :data:`FP8_MAX`, rounded up
    to a bfloat16 value (1 + 2^-7 covers bf16's rounding), 1 for an all-zero row; the codes are
    ``weight / scale`` in float8_e4m3fn. One row block at a time in float32, so a 16-bit weight never has a
    whole float32 copy."""
    rows = weight.shape[0]
    codes = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=weight.device)
    scale = torch.empty((rows, 1), dtype=torch.bfloat16, device=weight.device)
    if weight.is_meta:  # no values to scale (the estimate's meta model): the shapes and dtypes are the answer
        return codes, scale
    step = max(1, (1 << 22) // max(1, weight.shape[1]))  # ~16 MiB of float32 per block
    for lo in range(0, rows, step):
        block = weight[lo:lo + step].float()
        top = block.abs().amax(dim=1, keepdim=True)
        s = torch.where(top > 0, top / FP8_MAX * (1 + 2**-7), torch.ones_like(top)).to(torch.bfloat16)
        scale[lo:lo + step] = s
        codes[lo:lo + step] = (block / s.float()).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def enable_fp8_base_weights(denoiser: torch.nn.Module) -> None:
    """Store :func:`quantised_layers`' weights as scaled fp8 (module docstring), layer by layer; each
    matmul dequantises to its input's dtype. Layers already stored so (loaded from an fp8-scaled file) stay
    as they are."""
    modules = dict(denoiser.named_modules())
    for name in quantised_layers(denoiser, "fp8"):
        layer = modules[name]
        if not isinstance(layer, ScaledFp8Linear):
            fp8_layer(layer)
    bad = [n for n, p in denoiser.named_parameters() if p.requires_grad and p.dtype == torch.float8_e4m3fn]
    if bad:
        raise ValueError(f"train.base_weights fp8 cast trained weights to float8 (e.g. {bad[0]}); "
                         "check train.lora.targets")


def fp8_layer(layer: torch.nn.Linear) -> None:
    """Store one Linear's weight as scaled fp8 (:class:`ScaledFp8Linear`)."""
    weight = layer._parameters.pop("weight").detach()
    codes, scale = scaled_fp8(weight)
    del weight
    layer.register_buffer("weight", codes.view(torch.uint8), persistent=False)
    layer.register_buffer("weight_scale", scale.view(torch.uint16), persistent=False)
    layer.__class__ = ScaledFp8Linear


def cast_layerwise_fp8(denoiser: torch.nn.Module, compute: torch.dtype) -> None:
    """diffusers' layerwise casting to unscaled float8_e4m3fn (each layer cast to ``compute`` for its forward
    and back after). Not a training option: the estimate applies it to a ``meta`` model to count the 16-bit
    weight copies that int8's matmuls save for the backward pass."""
    denoiser.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=compute,
                                      skip_modules_classes=FP8_SKIPPED_CLASSES)


#: ``train.base_weights`` values stored as torchao tensor subclasses (:func:`enable_quantised_base_weights`).
QUANTISED = ("int8", "nf4")
#: QLoRA's NF4 layout: an absmax scale per 64 weights, those scales quantised to int8 in groups of 256.
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256


def nf4_scaler_block(numel: int) -> int | None:
    """The scaler group NF4 uses for a weight of ``numel`` elements: 256 wherever the 64-weight blocks
    divide by it (every Linear of the published models), else the largest power of two that divides them (the
    tiny flavors' narrow layers); ``None`` where ``numel`` is not a multiple of 64 (that layer is not
    quantised)."""
    if numel % NF4_BLOCK:
        return None
    blocks, size = numel // NF4_BLOCK, NF4_SCALER_BLOCK
    while blocks % size:
        size //= 2
    return size


def nf4_bytes(numel: int, width: int) -> int:
    """Bytes of torchao's ``NF4Tensor`` for a weight of ``numel`` elements quantised from a ``width``-byte
    dtype: two 4-bit codes per byte, an int8 scale per block, a ``width`` factor per scaler group, the
    scales' mean and the 16-entry code table."""
    blocks = numel // NF4_BLOCK
    return numel // 2 + blocks + blocks // nf4_scaler_block(numel) * width + width + 16 * width


def nf4_dequantise_bytes(numel: int, width: int) -> int:
    """Peak temporaries of dequantising one NF4 weight (torchao's ``get_original_weight``): each half of
    the codes as int64 indices (8 bytes per weight in all), then both halves looked up, scaled and stacked
    into the ``width``-byte weight, all alive at the stack."""
    return numel * (8 + 3 * width)


def quantised_layers(denoiser: torch.nn.Module, kind: str = "int8") -> list[str]:
    """The Linear layers ``base_weights: int8`` / ``nf4`` quantise: frozen, not a LoRA layer, and not one
    that diffusers' layerwise casting keeps in 16/32 bits (norms and AdaLN modulation, embeddings,
    ``proj_in`` / ``proj_out``), so they are the layers fp8 stores in float8; for ``nf4``, also only
    weights of a multiple of 64 elements (every one at real size)."""
    return [name for name, m in denoiser.named_modules()
            if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad and quantisable(name, m, kind)]


def quantisable(name: str, layer: torch.nn.Linear, kind: str) -> bool:
    """Whether :func:`quantised_layers` takes the Linear ``layer`` named ``name`` (frozen or not)."""
    return ("lora_" not in name and not any(re.search(p, name) for p in DEFAULT_SKIP_MODULES_PATTERN)
            and (kind != "nf4" or nf4_scaler_block(layer.weight.numel()) is not None))


def enable_quantised_base_weights(denoiser: torch.nn.Module, compute: torch.dtype, kind: str) -> None:
    """Store :func:`quantised_layers`' weights quantised from ``compute``, dequantised to it in each matmul:
    ``int8`` with a scale per output channel (torchao's ``Int8WeightOnlyConfig``), ``nf4`` as torchao's
    ``NF4Tensor`` (module docstring). The LoRA wraps the quantised layer unchanged (its own weights stay
    trainable in full precision).

    Each quantised weight becomes a non-persistent buffer of its Linear: frozen, out of the optimizer and
    of checkpoints as before, left alone by DeepSpeed's cast of the parameters, and moved by ``Module.to``
    by reassignment; as a parameter, a tensor subclass must be swapped in place, which DeepSpeed's weak
    references to parameters forbid.
    """
    _torchao(kind)  # refused before any layer changes
    modules = dict(denoiser.named_modules())
    for name in quantised_layers(denoiser, kind):
        torchao_layer(modules[name], compute, kind)
    bad = [n for n, p in denoiser.named_parameters() if p.requires_grad and type(p) is not torch.nn.Parameter]
    if bad:
        raise ValueError(f"train.base_weights {kind} quantised trained weights (e.g. {bad[0]}); check "
                         "train.lora.targets")


def _torchao(kind: str) -> tuple[type, type, Callable]:
    """torchao's ``Int8WeightOnlyConfig``, ``NF4Tensor`` and ``quantize_``; a clear error without torchao."""
    try:
        # deferred: torchao costs seconds to import and only int8 / nf4 runs need it
        from torchao.quantization import Int8WeightOnlyConfig, NF4Tensor, quantize_
    except ImportError as err:
        raise ValueError(f"train.base_weights {kind} needs torchao ({err}); reinstall diffpipe's dependencies "
                         "or use base_weights fp8") from err
    return Int8WeightOnlyConfig, NF4Tensor, quantize_


def torchao_layer(layer: torch.nn.Linear, compute: torch.dtype, kind: str) -> None:
    """Store one Linear's weight quantised from ``compute`` by torchao (``int8`` or ``nf4``, see
    :func:`enable_quantised_base_weights`), as a non-persistent buffer."""
    int8_config, nf4_tensor, quantize_ = _torchao(kind)
    # quantised from the compute dtype: the dtype the matmul dequantises to
    layer.weight.data = layer.weight.data.to(compute)
    if kind == "int8":
        quantize_(layer, int8_config(), filter_fn=lambda module, name: module is layer)
    weight = layer._parameters.pop("weight").detach()
    if kind == "nf4":
        weight = nf4_tensor.from_tensor(weight.contiguous(), NF4_BLOCK, nf4_scaler_block(weight.numel()))
    layer.register_buffer("weight", weight, persistent=False)


def quantise_layer(layer: torch.nn.Linear, kind: str, compute: torch.dtype) -> None:
    """Store one Linear's frozen weight as ``train.base_weights`` ``kind`` (fp8, int8 or nf4) says."""
    if kind == "fp8":
        fp8_layer(layer)
    else:
        torchao_layer(layer, compute, kind)


def compile_blocks(denoiser: torch.nn.Module, **compile_kwargs) -> None:
    """Regional compilation: each repeated block compiled once (diffusers' ``compile_repeated_blocks``
    where the model declares ``_repeated_blocks``), else each block of its top-level ``ModuleList``s.

    ``compile_kwargs`` go to ``torch.compile`` (tests pass ``backend="aot_eager"``, which needs no C++
    compiler; training uses the default inductor backend, which on CPU needs one)."""
    if getattr(denoiser, "_repeated_blocks", None):
        denoiser.compile_repeated_blocks(**compile_kwargs)
        return
    lists = [m for m in denoiser.children() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise ValueError(f"train.compile: {type(denoiser).__name__} has no repeated blocks to compile")
    for blocks in lists:
        for block in blocks:
            block.compile(**compile_kwargs)
