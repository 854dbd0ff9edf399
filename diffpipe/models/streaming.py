"""Loading a diffusers model tensor by tensor, so system RAM never holds the whole model at its load dtype.

``from_pretrained`` reads a weight file whole and holds the model at its load dtype before any other step
can run, so storing the frozen weights in 8 or 4 bits (``train.base_weights``) needed system RAM for the full
16-bit model first. Here the model is built with its parameters on the ``meta`` device (no memory; buffers the
model computes in ``__init__``, such as rotary tables, are built for real, as diffusers' own
``low_cpu_mem_usage`` load builds them), then each tensor is read from the safetensors file(s), cast as ``from_pretrained(torch_dtype=...)`` casts it (floating tensors to the load dtype,
``_keep_in_fp32_modules`` to float32, others as stored) and put in its module. When a module's last tensor
arrives, ``finish(name, module)`` runs (the trainer quantises a Linear there) and then
``place(name, module)`` (the trainer moves the module's own tensors to where they will live). So the peak is
what has been placed in host memory plus one layer in flight. Files are read with plain reads, not mapped
(:func:`safetensors_entries`).

Only plain diffusers folders with safetensors files stream; :func:`why_not_streamed` names what does not (a
single-file checkpoint goes through diffusers' converters, which need the whole state dict).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from diffusers.models.modeling_utils import no_init_weights

from diffpipe.models import _common as common
from diffpipe.models.meta import parameters_on_meta

Hook = Callable[[str, torch.nn.Module], None]


def empty_model(cls: type, config: dict[str, Any], dtype: torch.dtype) -> torch.nn.Module:
    """``cls.from_config(config)`` with its parameters on ``meta``, built under ``dtype`` as the default
    floating dtype and without running weight initialisers (as ``from_pretrained`` builds it)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with no_init_weights(), parameters_on_meta():
            return cls.from_config(config)
    finally:
        torch.set_default_dtype(previous)


def why_not_streamed(cfg: Any, subfolder: str) -> str | None:
    """Why ``model``'s ``subfolder`` cannot be streamed (None when it can): tiny flavors are built in memory,
    single files need diffusers' converters, ``.bin`` files are not read tensor by tensor."""
    if cfg.flavor == "tiny":
        return "the tiny flavor is built in memory"
    if cfg.single_files.get(subfolder):
        return f"model.single_files.{subfolder} is converted by diffusers as a whole"
    files = common.weight_files(Path(cfg.path) / subfolder, cfg.weight_variant)
    if files[0].suffix != ".safetensors":
        return f"{files[0].name} is not a safetensors file"
    return None


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def safetensors_entries(file: Path) -> Iterable[tuple[str, Callable[[], torch.Tensor]]]:
    """``(name, read)`` for each tensor of a safetensors file, in file order; ``read()`` reads that tensor
    into fresh memory with a plain file read. Not memory-mapped: the pages of a mapped file count in the
    process's resident memory until it is closed, so a mapped read of a 24 GB file looks like 24 GB of RAM
    (the kernel can drop them, but limits and the peak-RSS figures count them). The layout is the format's:
    an 8-byte little-endian header length, a JSON header of dtype, shape and byte offsets, then the data."""
    with open(file, "rb") as f:
        try:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        except (struct.error, ValueError, UnicodeDecodeError) as err:
            raise ValueError(f"{file}: not a safetensors file ({err})") from err
        base = 8 + size
        header.pop("__metadata__", None)
        for key, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            if entry["dtype"] not in _DTYPES:
                raise ValueError(f"{file}: tensor {key} has dtype {entry['dtype']}, which diffpipe cannot load")

            def read(key=key, entry=entry) -> torch.Tensor:
                start, end = entry["data_offsets"]
                data = torch.empty(end - start, dtype=torch.uint8)
                f.seek(base + start)
                if f.readinto(data.numpy()) != end - start:
                    raise ValueError(f"{file}: truncated (tensor {key})")
                return data.view(_DTYPES[entry["dtype"]]).reshape(entry["shape"])

            yield key, read


def _fp32_kept(model: torch.nn.Module, key: str) -> bool:
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    return any(name in key.split(".") for name in keep)


def _cast(model: torch.nn.Module, key: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The tensor as ``from_pretrained(torch_dtype=dtype)`` stores it."""
    if tensor.is_floating_point():
        tensor = tensor.to(torch.float32 if _fp32_kept(model, key) else dtype)
    return tensor.contiguous()


def _put(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    if name in module._parameters:
        old = module._parameters[name]
        module._parameters[name] = type(old)(tensor, requires_grad=old.requires_grad)
    else:
        module._buffers[name] = tensor


def _pending(model: torch.nn.Module) -> dict[str, set[str]]:
    """Each module's own state-dict tensors, by module name."""
    out: dict[str, set[str]] = {}
    for key in model.state_dict(keep_vars=True):
        prefix, _, local = key.rpartition(".")
        out.setdefault(prefix, set()).add(local)
    return out


def stream_into(model: torch.nn.Module, files: list[Path], dtype: torch.dtype, *, finish: Hook, place: Hook,
                what: str) -> None:
    """Fill ``model`` (from :func:`empty_model`) from safetensors ``files``, one tensor at a time (module
    docstring); every module is ``place``d, those without state-dict tensors too. A tensor the model lacks or
    one it has that no file holds is an error naming them, as is a shape that differs."""
    pending, modules = _pending(model), dict(model.named_modules())
    expected = model.state_dict(keep_vars=True)
    unknown: list[str] = []
    for file in files:
        for key, read in safetensors_entries(file):
            prefix, _, local = key.rpartition(".")
            if local not in pending.get(prefix, ()):
                unknown.append(key)
                continue
            tensor = read()
            if tuple(tensor.shape) != tuple(expected[key].shape):
                raise ValueError(f"{what}: {file} holds {key} of shape {tuple(tensor.shape)}, the model "
                                 f"expects {tuple(expected[key].shape)}; is it a checkpoint of this model?")
            _put(modules[prefix], local, _cast(model, key, tensor, dtype))
            del tensor
            pending[prefix].discard(local)
            if not pending[prefix]:
                finish(prefix, modules[prefix])
                place(prefix, modules[prefix])
    missing = sorted(f"{p}.{n}" if p else n for p, names in pending.items() for n in names)
    if missing or unknown:
        raise ValueError(f"{what}: {', '.join(str(f) for f in files)} does not match {type(model).__name__}: "
                         f"{len(missing)} tensor(s) missing (e.g. {', '.join(missing[:3]) or '-'}), {len(unknown)} "
                         f"unknown (e.g. {', '.join(unknown[:3]) or '-'}); is it a checkpoint of this model?")
    for name, module in modules.items():
        if name not in pending:  # no state-dict tensor of its own: computed buffers only, or none
            place(name, module)


def stream_component(cls: type, cfg: Any, subfolder: str, dtype: torch.dtype, *,
                     hooks: Callable[[torch.nn.Module], tuple[Hook, Hook]] | None = None) -> torch.nn.Module:
    """The diffusers model ``cls`` of the local folder's ``subfolder``, loaded tensor by tensor in ``dtype``
    (:func:`stream_into`), registered and in eval mode as ``from_pretrained`` leaves it. ``hooks(model)``
    gives ``(finish, place)`` for the empty model (none: the tensors stay as read)."""
    config = dict(cls.load_config(cfg.path, subfolder=subfolder))
    model = empty_model(cls, config, dtype)
    files = common.weight_files(Path(cfg.path) / subfolder, cfg.weight_variant)
    nothing: Hook = lambda name, module: None  # noqa: E731
    finish, place = hooks(model) if hooks is not None else (nothing, nothing)
    stream_into(model, files, dtype, finish=finish, place=place, what=f"model.path {cfg.path} {subfolder}/")
    model.register_to_config(_name_or_path=cfg.path)
    return model.eval()
