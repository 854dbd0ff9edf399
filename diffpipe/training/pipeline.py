"""Pipeline parallelism: splitting a family's layer list over stages.

The denoiser is a layer list (``Family.pipeline_layers``); stages get
contiguous runs of layers. ``balanced_split`` balances the parameter count
of every layer, frozen weights included: with LoRA nearly nothing is
trainable, and DeepSpeed's own ``partition_method="parameters"`` counts only
trainable weights, which would leave one stage holding most of the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from diffpipe.config import ObjectiveConfig, TrainConfig
from diffpipe.models import objectives as obj
from diffpipe.models.layers import _pipe_ready
from diffpipe.training import adapter
from diffpipe.training.engine import deepspeed_config, load_deepspeed
from diffpipe.training.optim import build_optimizer


def layer_sizes(layers: list[torch.nn.Module]) -> list[int]:
    """Parameters per layer, frozen ones included (a module shared by layers counts once)."""
    seen: set[int] = set()
    sizes = []
    for layer in layers:
        n = 0
        for p in layer.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        sizes.append(n)
    return sizes


def balanced_split(sizes: list[int], stages: int) -> list[int]:
    """Stage boundaries ``[0, b1, ..., len(sizes)]`` minimising the largest stage's parameter count.

    Exact (binary search on the bottleneck with a greedy check); every stage
    gets at least one layer.
    """
    if not 1 <= stages <= len(sizes):
        raise ValueError(f"cannot split {len(sizes)} layers over {stages} pipeline stages")

    def cuts(limit: int) -> list[int] | None:
        bounds, total = [0], 0
        for i, s in enumerate(sizes):
            left_layers, left_stages = len(sizes) - i, stages - (len(bounds) - 1)
            if total and (total + s > limit or left_layers < left_stages):
                bounds.append(i)
                total = 0
            total += s
            if s > limit:
                return None
        return bounds + [len(sizes)] if len(bounds) <= stages else None

    lo, hi = max(sizes), sum(sizes)
    while lo < hi:
        mid = (lo + hi) // 2
        if cuts(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    bounds = cuts(lo)
    assert bounds is not None
    # Fewer stages used than asked (one layer dominates): split the tail so each stage has a layer.
    while len(bounds) - 1 < stages:
        widths = [(bounds[i + 1] - bounds[i], i) for i in range(len(bounds) - 1)]
        width, i = max(widths)
        bounds.insert(i + 1, bounds[i] + width // 2)
    return bounds


def manual_split(boundaries: list[int], n_layers: int, stages: int) -> list[int]:
    """Validate a user's split: the first layer index of each stage after the first."""
    bounds = [0, *boundaries, n_layers]
    if len(bounds) - 1 != stages or any(b >= a for a, b in zip(bounds[1:], bounds, strict=False)):
        raise ValueError(
            f"pipeline split {boundaries}: need {stages - 1} increasing layer indices between 1 and "
            f"{n_layers - 1} (the first layer of each stage after the first)"
        )
    return bounds


# -- the DeepSpeed pipeline engine ----------------------------------------------------------
class _StageEdge(torch.nn.Module):
    """A layer at a stage boundary, made to meet what DeepSpeed's pipeline engine asks there.

    The engine calls ``backward`` on every float tensor a stage sends, and sends back a
    gradient for every float tensor a stage received. ``exit`` (a stage's last layer): sent
    tensors are made contiguous (``send`` takes no other: a block's output sliced from a joint
    sequence is not), and those without a graph (computed from frozen weights only) become
    grad-requiring leaves.
    ``entry`` (a stage's first layer): every received float tensor is tied to the output with
    weight zero, so it gets a (zero) gradient even where the stage leaves it unused (a UNet
    block without cross-attention, the output layer); the output's values are unchanged.
    """

    def __init__(self, layer: torch.nn.Module, *, entry: bool, exit: bool):
        super().__init__()
        self.layer, self.entry, self.exit = layer, entry, exit

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        out = self.layer(inputs)
        if self.entry and torch.is_grad_enabled():
            tied = [x.sum() for x in inputs if x.is_floating_point() and x.requires_grad]
            if tied:
                i = next(i for i, y in enumerate(out) if y.is_floating_point())
                out = (*out[:i], out[i] + (sum(tied) * 0).to(out[i].dtype), *out[i + 1 :])
        return _pipe_ready(tuple(t.contiguous() for t in out)) if self.exit else out


def stage_edges(layers: list[torch.nn.Module], bounds: list[int]) -> list[torch.nn.Module]:
    """``layers`` with each stage's first and last layer wrapped for the engine (see ``_StageEdge``)."""
    entries, exits = set(bounds[1:-1]), {b - 1 for b in bounds[1:-1]}
    return [_StageEdge(layer, entry=i in entries, exit=i in exits) if i in entries | exits else layer
            for i, layer in enumerate(layers)]


def stage_bounds(layers: list[torch.nn.Module], tc: TrainConfig) -> list[int]:
    """``train.pipeline_split`` if given, else the frozen-weight-aware balanced split."""
    if tc.pipeline_split:
        return manual_split(tc.pipeline_split, len(layers), tc.pipeline_stages)
    return balanced_split(layer_sizes(layers), tc.pipeline_stages)


def build_pipeline_engine(layers: list[torch.nn.Module], bounds: list[int], loss_fn: Callable, tc: TrainConfig,
                          world_size: int, make_scheduler: Callable) -> tuple[Any, list[torch.nn.Parameter]]:
    """A DeepSpeed ``PipelineEngine`` over ``layers`` split at ``bounds``, data parallel across the rest.

    Returns the engine and this stage's trainable parameters (the optimizer sees only those).
    """
    deepspeed = load_deepspeed()
    from deepspeed.pipe import PipelineModule  # deferred: as load_deepspeed; only a pipeline-parallel run

    class _Pipe(PipelineModule):
        def _partition_layers(self, method: str = "uniform") -> None:  # our split, not DeepSpeed's
            self.parts = list(bounds)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    # dynamic_shape: micro-batches of other buckets (and prompt lengths) send tensors of other shapes.
    module = _Pipe(layers=stage_edges(layers, bounds), num_stages=tc.pipeline_stages, loss_fn=loss_fn,
                   activation_checkpoint_interval=1 if tc.activation_checkpointing else 0, dynamic_shape=True)
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        stage = module.stage_id
        raise ValueError(
            f"train.pipeline_stages: stage {stage} (layers {bounds[stage]}-{bounds[stage + 1] - 1} of {len(layers)}) "
            "has nothing to train (no LoRA target in its layers); move the split with train.pipeline_split or "
            "add targets there (train.lora.targets)"
        )
    optimizer = build_optimizer(params, tc)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=make_scheduler(optimizer),
                                           config=deepspeed_config(tc, world_size // tc.pipeline_stages))
    return engine, params


def pipeline_loss_fn(objective: ObjectiveConfig) -> Callable:
    """DeepSpeed's ``loss_fn(outputs, labels)`` on the last stage; labels are ``(target, weights)``, with the
    family's element mask third where it has one (:meth:`Family.pipeline_inputs`)."""

    def loss_fn(outputs: Any, labels: tuple[torch.Tensor, ...]) -> torch.Tensor:
        pred = outputs[0] if isinstance(outputs, tuple) else outputs
        target, weights, *mask = labels
        return obj.per_sample_loss(pred, target, weights, kind=objective.loss, huber_c=objective.huber_c,
                                   mask=mask[0] if mask else None).mean()

    return loss_fn


def stage_lora_state(denoiser: torch.nn.Module, stage_params: list[torch.nn.Parameter],
                     world_size: int) -> tuple[dict[str, torch.Tensor], bool]:
    """The whole LoRA, gathered from the stages that own its parts (collective).

    Also says whether the data-parallel replicas of every stage agree.
    """
    own = {id(p) for p in stage_params}
    keys = {name.replace(".default", "") for name, p in denoiser.named_parameters() if id(p) in own}
    mine = {k: v for k, v in adapter.lora_state_dict(denoiser).items() if k in keys}
    parts: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(parts, mine)
    merged: dict[str, torch.Tensor] = {}
    agree = True
    for part in parts:
        for k, v in part.items():
            agree &= k not in merged or torch.equal(merged[k], v)
            merged[k] = v
    return merged, agree
