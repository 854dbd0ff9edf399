"""A model built without its weights (parameters on the ``meta`` device), and a checkpoint's tensor names
checked against it before anything is read: shared by the streamed load (:mod:`diffpipe.models.streaming`),
single-file checkpoints and fp8-scaled files (:mod:`diffpipe.models.comfy_fp8`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside, every parameter a module registers goes to the ``meta`` device (its buffers stay real)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def require_names(expected: set[str], found: Iterable[str], what: str, file: object, model: str) -> None:
    """A clear error naming ``file`` when its tensor names (after conversion) are not the model's."""
    found = set(found)
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        raise ValueError(
            f"{what}: {file} does not match {model}: {len(missing)} tensor(s) missing (e.g. "
            f"{', '.join(missing[:3]) or '-'}), {len(unexpected)} unknown (e.g. {', '.join(unexpected[:3]) or '-'}); "
            "is it a checkpoint of this model?")
