"""The small records a family's parts pass around: the trained pipeline parts, a batch's prepared
training inputs and a flow-matching draw."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class DenoiserPart:
    """One pipeline component a run trains a LoRA on, and how its exported LoRA loads back.

    A run trains one part, except Wan 2.2 A14B with ``model.expert: both``: its trained
    module then holds each part as a submodule named ``attr``, so the adapter's keys
    start with ``<attr>.``, and export writes one LoRA per part.
    """

    #: The stock pipeline's attribute (``transformer_2``).
    attr: str
    #: Added to every export name of this part (``pytorch_lora_weights_low_noise.safetensors``); "" for the first.
    suffix: str = ""
    #: Extra ``load_lora_weights`` arguments that route its diffusers file into ``attr``.
    load_kwargs: dict[str, Any] = field(default_factory=dict)
    #: What the model card calls it ("low-noise expert").
    label: str = ""


def split_parts(state_dict: dict[str, torch.Tensor], parts: tuple[DenoiserPart, ...]) -> dict[str, dict[str, torch.Tensor]]:
    """An adapter's tensors per part (``attr -> tensors keyed relative to that part``).

    One part: the state as is. Several: each ``<attr>.`` prefix is taken off; a key that
    names no part is an error (the adapter was not trained on this model's parts).
    """
    if len(parts) == 1:
        return {parts[0].attr: state_dict}
    out: dict[str, dict[str, torch.Tensor]] = {p.attr: {} for p in parts}
    for key, value in state_dict.items():
        attr = key.split(".", 1)[0]
        if attr not in out:
            raise ValueError(f"adapter key {key!r} names no trained part (expected one of {', '.join(out)})")
        out[attr][key.split(".", 1)[1]] = value
    empty = [a for a, sd in out.items() if not sd]
    if empty:
        raise ValueError(f"the adapter has no tensors for {', '.join(empty)}; was it trained with every part?")
    return out



@dataclass
class Prepared:
    """One batch's training inputs, built once by :meth:`Family.prepare`.

    The loss forwards the denoiser on ``inputs`` (:meth:`Family.predict`) and compares
    with ``target``; pipeline-parallel training sends ``inputs`` (:meth:`Family.layer_inputs`)
    into the first layer and ``(target, weights)`` to the last stage's loss.
    """

    #: The denoiser's forward keyword arguments, in the order of the first pipeline layer's tuple.
    inputs: dict[str, Any]
    #: What the prediction is compared with, laid out like it (packed into tokens where the family packs).
    target: torch.Tensor
    #: Per-sample loss weights ``[B]`` (Min-SNR, SD3's weighting schemes); None: unweighted.
    weights: torch.Tensor | None = None
    #: Per-element loss weights laid out like ``target`` (:meth:`Family.loss_mask`); None: unmasked.
    mask: torch.Tensor | None = None
    #: What else the family's ``predict`` reads (reference tokens, the latent grid to unpack to, ...).
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class FlowDraw:
    """A flow-matching draw of image latents ``[B, C, h, w]``, packed into tokens where the family packs."""

    x0: torch.Tensor
    sigma: torch.Tensor
    #: ``flow_interpolate(x0, noise, sigma)`` and ``flow_target(x0, noise)``, packed.
    noisy: torch.Tensor
    target: torch.Tensor
    #: The pipeline's packing for this batch's latent shape; None: unpacked.
    pack: Any = None

    @property
    def grid(self) -> tuple[int, int]:
        """Token rows and columns of a 2x2 packing: the latent grid halved."""
        return self.x0.shape[-2] // 2, self.x0.shape[-1] // 2
