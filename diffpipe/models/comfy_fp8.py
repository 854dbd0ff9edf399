"""ComfyUI's fp8-scaled single-file checkpoints (``*_fp8_scaled.safetensors``) as a base denoiser.

The layout: the original checkpoint's names (BFL, Wan, Qwen-Image, ...), each quantised Linear with
``<prefix>.weight`` in float8_e4m3fn and ``<prefix>.scale_weight``, a float32 scale for the whole tensor (one
element) or one per output row, so the weight is ``weight.float() * scale_weight``; ``<prefix>.scale_input``
sometimes (a scale for fp8 activations in ComfyUI's fp8 matmul, which does not apply here: our matmul computes
in the compute dtype) and an empty ``scaled_fp8`` marker tensor. Other tensors (norms, biases, embedders) are
16- or 32-bit.

Loading builds each quantised Linear as a :class:`~diffpipe.models.casting.ScaledFp8Linear` straight from the
file's codes and scales (the scale kept in float32, one per row: a per-tensor scale repeated), so no 16-bit
copy of the model exists at any time. Names go through the converter diffusers uses for that model class,
run twice in step: once on the codes (as uint8 views, which it splits and joins like any tensor) and once on
the scales as ``[rows, 1]`` columns beside the same other tensors, so a fused layer (FLUX's ``qkv``,
``linear1``) split into row blocks gets each block's scales. The other tensors load in the requested dtype.

Only ``train.base_weights: fp8`` trains on such a denoiser (:func:`require_fp8_base`): the file holds 8-bit
weights, so a 16-bit copy would double their memory without adding information, int8 / nf4 would quantise
already-quantised weights a second time, and a full fine-tune cannot train frozen codes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from diffusers.models.modeling_utils import no_init_weights
from safetensors import safe_open

from diffpipe.models.casting import ScaledFp8Linear
from diffpipe.models.meta import parameters_on_meta, require_names

SCALE, INPUT_SCALE, MARKER = ".scale_weight", ".scale_input", "scaled_fp8"
_FLOAT8 = (torch.float8_e4m3fn,)
#: Attribute of a model loaded from an fp8-scaled file: "<file> (e.g. <tensor>)", for error messages.
SOURCE_ATTR = "diffpipe_scaled_fp8_source"


def scaled_fp8_key(file: str | Path) -> str | None:
    """The first ``*.scale_weight`` tensor of a safetensors file (read from its header only), or None: the
    file is not in the fp8-scaled layout."""
    if Path(file).suffix != ".safetensors":
        return None
    with safe_open(str(file), framework="pt") as f:
        return next((k for k in sorted(f.keys()) if k.endswith(SCALE)), None)


def _read(file: str | Path, what: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(tensors, scales)``: every tensor but the scales and the marker, float8 weights as uint8 views; and
    for each float8 weight its scale as a float32 ``[rows, 1]`` column (1 where the file has none)."""
    tensors, scales = {}, {}
    with safe_open(str(file), framework="pt") as f:
        keys = set(f.keys())
        for key in sorted(keys):
            if key.endswith((SCALE, INPUT_SCALE)) or key == MARKER:
                continue
            t = f.get_tensor(key)
            if t.dtype == torch.float8_e5m2:
                raise ValueError(f"{what}: {file}: tensor {key} is float8_e5m2; fp8-scaled files are read with "
                                 "float8_e4m3fn weights only")
            if t.dtype not in _FLOAT8:
                tensors[key] = t
                continue
            if t.ndim != 2 or not key.endswith(".weight"):
                raise ValueError(f"{what}: {file}: tensor {key} is {t.dtype} {tuple(t.shape)}; only the 2-D "
                                 "weights of Linear layers can be float8 in an fp8-scaled file")
            prefix = key[: -len(".weight")]
            scale = f.get_tensor(prefix + SCALE).float() if prefix + SCALE in keys else torch.ones(())
            if scale.numel() not in (1, t.shape[0]):
                raise ValueError(f"{what}: {file}: {prefix}{SCALE} has shape {tuple(scale.shape)}; a scale is "
                                 f"one value or one per output row ({t.shape[0]}) of {key}")
            tensors[key] = t.view(torch.uint8)
            scales[key] = scale.reshape(-1, 1).expand(t.shape[0], 1).contiguous()
    return tensors, scales


def _converted(tensors: dict[str, torch.Tensor], scales: dict[str, torch.Tensor], expected: set[str],
               convert: Callable[..., dict], config: Mapping[str, Any]) -> tuple[dict, dict]:
    """Both dicts in diffusers' names (unchanged when the file already uses them); the scales come back for
    the converted weights that are codes (uint8). The converter empties ``tensors`` as it goes, so each
    original tensor is freed once converted (a split or join copies only one layer at a time)."""
    if set(tensors) == expected:
        return tensors, scales
    beside = convert(checkpoint={**{k: v for k, v in tensors.items() if k not in scales}, **scales},
                     config=dict(config))
    codes = convert(checkpoint=tensors, config=dict(config))
    return codes, {k: beside[k] for k, v in codes.items() if v.dtype == torch.uint8}


def load_scaled_fp8(cls: type, file: str | Path, config: Mapping[str, Any], convert: Callable[..., dict],
                    dtype: torch.dtype, what: str) -> torch.nn.Module:
    """``cls`` (config ``config``) with the weights of the fp8-scaled file ``file`` (module docstring), in
    eval mode; ``convert`` is diffusers' converter for ``cls``, ``what`` names the config key in errors."""
    with no_init_weights(), parameters_on_meta():  # buffers (rotary tables) real
        model = cls.from_config(config)
    expected = set(model.state_dict())
    tensors, scales = _read(file, what)
    try:
        tensors, scales = _converted(tensors, scales, expected, convert, config)
    except (ValueError, KeyError, IndexError, RuntimeError) as err:
        raise ValueError(f"{what}: cannot convert {file} to {cls.__name__}: {err!r}") from err
    require_names(expected, tensors, what, file, cls.__name__)
    for key, scale in scales.items():
        _install(model, key, tensors.pop(key), scale, f"{what}: {file}")
    fp32 = set(getattr(cls, "_keep_in_fp32_modules", None) or ()) if dtype == torch.float16 else set()
    rest = {k: v.to(torch.float32 if fp32 & set(k.split(".")) else dtype) if v.is_floating_point() else v
            for k, v in tensors.items()}
    model.load_state_dict(rest, strict=True, assign=True)
    setattr(model, SOURCE_ATTR, f"{file} (e.g. {next(iter(scales), '-')})")
    return model.eval()


def _install(model: torch.nn.Module, key: str, codes: torch.Tensor, scale: torch.Tensor, where: str) -> None:
    """Make the Linear owning weight ``key`` a ScaledFp8Linear holding ``codes`` and ``scale`` (float32 rows)."""
    layer = model.get_submodule(key.rpartition(".")[0])
    shape = tuple(layer.weight.shape) if isinstance(layer, torch.nn.Linear) else None
    if shape != tuple(codes.shape) or tuple(scale.shape) != (codes.shape[0], 1):
        raise ValueError(f"{where}: float8 tensor {key} {tuple(codes.shape)} (scales {tuple(scale.shape)}) does "
                         f"not land on a Linear weight of that shape ({type(layer).__name__} {shape})")
    del layer._parameters["weight"]
    layer.register_buffer("weight", codes.contiguous(), persistent=False)
    layer.register_buffer("weight_scale", scale.contiguous().view(torch.int32), persistent=False)
    layer.__class__ = ScaledFp8Linear


def require_fp8_base(denoiser: torch.nn.Module, base_weights: str) -> None:
    """Refuse to train a denoiser loaded from an fp8-scaled file unless ``train.base_weights`` is fp8 (module
    docstring says why)."""
    source = getattr(denoiser, SOURCE_ATTR, None)
    if source is None or base_weights == "fp8":
        return
    raise ValueError(
        f"model.single_files: {source} holds scaled fp8 weights; train.base_weights is {base_weights}, which "
        "would dequantise or re-quantise them: set train.base_weights: fp8 (and train.mode: lora) to train on "
        "this file, or give a 16-bit checkpoint of the model")
