"""Eval loss at fixed timestep quantiles with fixed noise.

Training loss jumps with the random timestep of each batch; the eval loss
does not: every eval item is scored at the same timesteps (quantiles of
[0, 1], e.g. 0.1 ... 0.9) with the same noise at every evaluation, so the
numbers compare across steps and across runs (the diffusion-pipe recipe).
The eval set is the cache's ``eval`` split when the plan has one, else a
fixed subset of the training items.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from diffpipe.config import EvalConfig
from diffpipe.data.cache.reader import CachedDataset
from diffpipe.models._common import param_dtype
from diffpipe.paths import RunPaths


@dataclass
class _Batch:
    latents: torch.Tensor
    text: dict[str, torch.Tensor]
    noise: torch.Tensor
    aux: dict[str, torch.Tensor]  # the loss's mask / control arguments


def aux_inputs(family, batch: dict[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    """The loss's keyword arguments from a batch's aux arrays: ``mask``, ``control`` for
    families that condition on it, and ``sizes`` for families whose loss takes them. Passed only when present, so a batch without aux arrays
    calls ``loss`` exactly as before."""
    kw = {}
    if batch.get("mask") is not None:
        kw["mask"] = batch["mask"].to(device)
    if family.uses_control:
        if batch.get("control_latents") is None:
            raise ValueError(f"model family {family.name!r} trains on items with a control image; items "
                             f"{batch.get('control_missing')} have none (set datasets[].control_path or "
                             "control_column, and keep validation.actions.missing_control at skip)")
        kw["control"] = batch["control_latents"].to(device)
        if batch.get("control_embeds") is not None:  # an image encoder's embedding of the control
            kw["control_embeds"] = batch["control_embeds"].to(device)
    if batch.get("base_target") is not None:  # datasets[].prior_target: base
        kw["base_target"] = batch["base_target"].to(device)
    if batch.get("sizes") is not None and family.uses_sizes:
        # Size / crop conditioning (SDXL's add_time_ids) of the items' planned crops.
        kw["sizes"] = {k: v.to(device) for k, v in batch["sizes"].items()}
    return kw


def eval_dataset(paths: RunPaths, train_data: CachedDataset) -> CachedDataset:
    """The cache's eval split if it holds items, else the training data."""
    try:
        data = CachedDataset.from_run(paths, split="eval")
    except TypeError:  # a reader without splits
        return train_data
    return data if len(data) else train_data


def eval_batches(data: CachedDataset, max_items: int, batch_size: int) -> list[list[int]]:
    """Up to ``max_items`` items (sorted by id: a fixed choice), batched within buckets."""
    chosen = sorted(range(len(data)), key=lambda i: data.items[i].id)[:max_items]
    by_bucket: dict[str, list[int]] = {}
    for i in chosen:
        by_bucket.setdefault(data.items[i].bucket, []).append(i)
    return [idx[k : k + batch_size] for _, idx in sorted(by_bucket.items()) for k in range(0, len(idx), batch_size)]


class Evaluator:
    """Scores a model on the fixed eval batches; call it on every rank (ZeRO-3 forwards collectively)."""

    def __init__(self, family, data: CachedDataset, cfg: EvalConfig, *, batch_size: int, device: torch.device):
        self.family, self.quantiles = family, list(cfg.quantiles)
        gen = torch.Generator().manual_seed(cfg.seed)
        self.batches = []
        for idx in eval_batches(data, cfg.max_items, batch_size):
            batch = data.collate(idx)
            latents = batch["latents"]
            noise = torch.randn(latents.shape, generator=gen)  # drawn once: the same at every eval
            self.batches.append(_Batch(latents.to(device), {k: v.to(device) for k, v in batch["text"].items()},
                                       noise.to(device), aux_inputs(family, batch, device)))
        self._unused = torch.Generator(device=device)

    def __call__(self, model) -> dict[str, float]:
        """``eval_loss_q<q>`` per quantile and their mean ``eval_loss``."""
        if not self.batches or not self.quantiles:
            return {}
        if hasattr(model, "eval_batch"):  # a DeepSpeed pipeline: the stages score together
            return self._pipeline(model)
        was_training = model.training
        model.eval()  # no LoRA dropout
        out = {}
        with torch.no_grad():
            for q in self.quantiles:
                total, n = 0.0, 0
                for b in self.batches:
                    t = torch.full((b.latents.shape[0],), q, device=b.latents.device)
                    loss = self.family.loss(model, b.latents, b.text, self._unused, t=t, noise=b.noise, **b.aux)
                    total, n = total + float(loss.sum()), n + loss.numel()
                out[f"eval_loss_q{q:g}"] = total / n
        model.train(was_training)
        out["eval_loss"] = sum(out.values()) / len(self.quantiles)
        return out

    def _pipeline(self, model) -> dict[str, float]:
        """Through ``eval_batch``: the mean of the per-batch losses (the training loss kind, unweighted)."""
        out = {}
        dtype = param_dtype(model)  # the stage's weights' (bf16 under train.precision bf16)
        for q in self.quantiles:
            def feed(q=q):
                for b in self.batches:
                    t = torch.full((b.latents.shape[0],), q, device=b.latents.device)
                    yield self.family.pipeline_inputs(b.latents, b.text, self._unused, dtype=dtype, t=t,
                                                      noise=b.noise, **b.aux)

            loss = model.eval_batch(data_iter=feed(), num_micro_batches=len(self.batches))
            out[f"eval_loss_q{q:g}"] = float(loss)
        out["eval_loss"] = sum(out.values()) / len(self.quantiles)
        return out
