"""What ``diffpipe import-lora`` checks in a file before it writes anything, against the model it is for.

Values: every tensor finite; alpha one finite number > 0; rank > 0 and the same in ``down``
and ``up``. Shapes: a LoRA's ``down`` is ``[rank, *weight.shape[1:]]`` and its ``up``
``[rows, rank, 1, ...]`` for the module's weight (a fused original layer: the rows of all its
modules); a LoKr's or LoHa's product has the weight's shape, worked out from the factor shapes
(a hostile file's product may be terabytes: it is never built). Header metadata (diffusers'
``lora_adapter_metadata``, a PEFT ``adapter_config.json``, our ``diffpipe.fused_layout``) is
parsed as JSON of the expected types. Every failure is a ``ValueError`` naming the file and
the key. The model's shapes come from the denoiser skeleton (on the meta device for a local
model) and the text encoders (likewise), never from loaded weights.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from diffpipe.models.base import Family
from diffpipe.models.keymap import LORA_LAYERS

#: Module name (or a file's layer name) -> the weight shape its update must have.
Shapes = Mapping[str, tuple[int, ...]]


def _bad(source: object, key: str, problem: str) -> ValueError:
    return ValueError(f"{source}: {key}: {problem}")


def module_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Weight shape of every LoRA-able module of ``model`` (meta tensors have shapes too)."""
    return {n: tuple(m.weight.shape) for n, m in model.named_modules() if isinstance(m, LORA_LAYERS)}


def text_encoder_shapes(family: Family, name: str) -> dict[str, tuple[int, ...]]:
    """The LoRA-able modules of text encoder ``name``: the tiny flavor's (built in a blink), or the
    local folder's config built on the meta device (no weights read)."""
    if family.cfg.flavor == "tiny":
        return module_shapes(getattr(family.load_text_encoders(only=[name]), name))
    cls = family.text_parts[name].cls
    config = cls.config_class.from_pretrained(family.cfg.path, subfolder=name)
    with torch.device("meta"):
        return module_shapes(cls(config))


def check_finite(source: object, key: str, tensor: torch.Tensor) -> None:
    if tensor.is_floating_point() and tensor.element_size() == 1:
        tensor = tensor.float()  # torch has no isfinite for every float8 type; a LoRA tensor is small
    bad = ~torch.isfinite(tensor)  # one tensor at a time, never the whole file at once
    if bad.any():
        raise _bad(source, key, f"{int(bad.sum())} of {tensor.numel()} values are NaN or infinite")


def alpha_value(source: object, key: str, value: Any) -> float:
    """A LoRA's alpha (a tensor or a JSON value): one finite number > 0."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise _bad(source, key, f"alpha must be one number, the file holds {value.numel()} "
                                    f"(shape {list(value.shape)})")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(source, key, f"alpha must be a number, not {json.dumps(value)[:80]}")
    if not math.isfinite(value) or value <= 0:
        raise _bad(source, key, f"alpha {value} must be finite and greater than 0")
    return float(value)


def check_lora(source: object, keys: tuple[str, str], down: torch.Tensor, up: torch.Tensor,
               weight: tuple[int, ...] | None) -> None:
    """One LoRA's ``down`` / ``up`` (file keys ``keys``) against the weight shape it updates."""
    down_key, up_key = keys
    for key, t in ((down_key, down), (up_key, up)):
        if t.ndim < 2:
            raise _bad(source, key, f"a LoRA matrix has at least 2 dimensions, this one has shape {list(t.shape)}")
    rank = down.shape[0]
    if rank == 0:
        raise _bad(source, down_key, "rank 0 (no rows): a LoRA needs rank 1 or more")
    if up.shape[1] != rank:
        raise _bad(source, up_key, f"has {up.shape[1]} columns, {down_key} has rank {rank}: they must agree")
    if weight is not None:
        for key, t, want in ((down_key, down, (rank, *weight[1:])),
                             (up_key, up, (weight[0], rank, *[1] * (len(weight) - 2)))):
            if tuple(t.shape) != want:
                raise _bad(source, key, f"shape {list(t.shape)} does not fit the model's layer (weight "
                                        f"{list(weight)}): expected {list(want)}; a LoRA for another model?")
    check_finite(source, down_key, down)
    check_finite(source, up_key, up)


def check_magnitude(source: object, key: str, t: torch.Tensor, weight: tuple[int, ...] | None) -> None:
    """A DoRA magnitude: one value per output row (PEFT keeps conv ones as ``[1, rows, 1, ...]``)."""
    if weight is not None:
        want = (weight[0],) if len(weight) == 2 else (1, weight[0], *[1] * (len(weight) - 2))
        if tuple(t.shape) != want:
            raise _bad(source, key, f"shape {list(t.shape)} does not fit the model's layer (weight "
                                    f"{list(weight)}): expected {list(want)}")
    check_finite(source, key, t)


def json_value(source: object, key: str, text: str) -> Any:
    """Header text ``key`` parsed as JSON (too deep or malformed: an error naming file and key)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise _bad(source, key, "JSON nested too deeply to read") from None
    except ValueError as err:
        raise _bad(source, key, f"not valid JSON ({err})") from None


def alpha_pattern(source: object, key: str, value: Any) -> dict[str, float]:
    """A PEFT ``alpha_pattern``: module-name regex -> alpha, each checked."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad(source, key, f"must map module-name patterns to alphas, not {json.dumps(value)[:80]}")
    out = {}
    for pattern, alpha in value.items():
        try:
            re.compile(pattern)
        except re.error as err:
            raise _bad(source, key, f"pattern {pattern!r} is not a valid regular expression ({err})") from None
        out[pattern] = alpha_value(source, f"{key}[{pattern!r}]", alpha)
    return out


def adapter_metadata(source: Path, header: Mapping[str, str], prefix: str) -> dict[str, Any]:
    """The PEFT config fields of component ``prefix`` (``unet.``) in a diffusers file's
    ``lora_adapter_metadata``, with the ones import reads (alpha, alpha_pattern, use_rslora) checked."""
    key = "lora_adapter_metadata"
    if key not in header:
        return {}
    packed = json_value(source, key, header[key])
    if not isinstance(packed, dict):
        raise _bad(source, key, f"must be a JSON object (config field -> value), not a {type(packed).__name__}")
    cfg = {k.removeprefix(prefix): v for k, v in packed.items() if k.startswith(prefix)}
    if "lora_alpha" in cfg:
        cfg["lora_alpha"] = alpha_value(source, f"{key}: {prefix}lora_alpha", cfg["lora_alpha"])
    cfg["alpha_pattern"] = alpha_pattern(source, f"{key}: {prefix}alpha_pattern", cfg.get("alpha_pattern"))
    if not isinstance(cfg.get("use_rslora", False), bool):
        raise _bad(source, f"{key}: {prefix}use_rslora", f"must be true or false, not {cfg['use_rslora']!r}")
    return cfg


def fused_layout(source: object, key: str, text: str) -> dict[str, list[tuple[str, int, float]]]:
    """Our ``diffpipe.fused_layout`` header: original layer -> its column blocks ``[module, rank, alpha]``."""
    layout = json_value(source, key, text)
    if not isinstance(layout, dict):
        raise _bad(source, key, f"must be a JSON object (layer -> blocks), not a {type(layout).__name__}")
    out = {}
    for layer, blocks in layout.items():
        where = f"{key}[{layer!r}]"
        if not isinstance(blocks, list) or not all(isinstance(b, list) and len(b) == 3 for b in blocks):
            raise _bad(source, where, "must be a list of [module, rank, alpha] blocks")
        for module, rank, alpha in blocks:
            if not isinstance(module, str) or isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
                raise _bad(source, where, f"block {[module, rank, alpha]}: a module name and a rank >= 1")
            alpha_value(source, where, alpha)
        out[layer] = [tuple(b) for b in blocks]
    return out


def _factor(source: object, name: str, t: Mapping[str, torch.Tensor], base: str, whole: bool
            ) -> tuple[str, tuple[int, ...]]:
    """The shape of factor ``base`` (``lokr_w1``): whole (``whole``: when the kind allows it) or
    ``base_a @ base_b``, and how the message names it."""
    a, b = t.get(f"{base}_a"), t.get(f"{base}_b")
    if base in t:
        if a is not None or b is not None:
            raise _bad(source, f"{name}.{base}", f"given both whole and as {base}_a / {base}_b: one or the other")
        return base, tuple(t[base].shape)
    if a is None or b is None:
        need = f"{base} or {base}_a and {base}_b" if whole else f"{base}_a and {base}_b"
        raise _bad(source, name, f"lacks {need}")
    for leaf, m in ((f"{base}_a", a), (f"{base}_b", b)):
        if m.ndim != 2 or 0 in m.shape:
            raise _bad(source, f"{name}.{leaf}", f"a factor is a matrix with rank >= 1, this one has shape {list(m.shape)}")
    if a.shape[1] != b.shape[0]:
        raise _bad(source, f"{name}.{base}_b", f"has {b.shape[0]} rows, {base}_a has {a.shape[1]} columns: "
                                               "they must agree")
    return f"{base}_a @ {base}_b", (a.shape[0], b.shape[1])


def check_product(source: object, name: str, kind: str, t: Mapping[str, torch.Tensor],
                  weight: tuple[int, ...] | None) -> None:
    """A LoKr (``kron(w1, w2)``) or LoHa (``(w1_a @ w1_b) * (w2_a @ w2_b)``) layer ``name``: each factor
    well formed and finite, and the product's shape, from the factor shapes, that of ``weight``."""
    for leaf, value in t.items():
        check_finite(source, f"{name}.{leaf}", value)
    if kind == "loha":
        n1, s1 = _factor(source, name, t, "hada_w1", whole=False)
        n2, s2 = _factor(source, name, t, "hada_w2", whole=False)
        if s1 != s2:
            raise _bad(source, name, f"LoHa factors {n1} {list(s1)} and {n2} {list(s2)} differ in shape")
        what, shape = f"({n1}) * ({n2})", s1
    else:
        n1, s1 = _factor(source, name, t, "lokr_w1", whole=True)
        n2, s2 = _factor(source, name, t, "lokr_w2", whole=True)
        if len(s1) != 2 or len(s2) < 2:
            raise _bad(source, name, f"LoKr factors {n1} {list(s1)} and {n2} {list(s2)}: w1 is a matrix, w2 "
                                     "a matrix or a conv kernel")
        what, shape = f"kron({n1}, {n2})", (s1[0] * s2[0], s1[1] * s2[1], *s2[2:])
    if weight is None:
        return
    # A 2-D product is reshaped to the weight (PEFT, ComfyUI); a conv-shaped one must match it as is.
    fits = shape == weight if len(shape) > 2 else shape == (weight[0], math.prod(weight[1:]))
    if not fits:
        label = {"lokr": "LoKr", "loha": "LoHa"}[kind]
        raise _bad(source, name, f"{label} product {what} has shape {list(shape)}, the model's layer has weight "
                                 f"{list(weight)}; a {label} for another model?")
