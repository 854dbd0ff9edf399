"""The training loop: setup, step, log, save. Reads only the caches."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from diffpipe.config import Config
from diffpipe.data.reader import CachedDataset
from diffpipe.models import get_family
from diffpipe.paths import RunPaths
from diffpipe.training import adapter, engine
from diffpipe.training.metrics import MetricsWriter, plot_loss, read_metrics
from diffpipe.training.schedules import lr_lambda
from diffpipe.utils import write_text_atomic


@dataclass
class TrainResult:
    steps: int
    epochs: int
    first_loss: float
    last_loss: float
    adapter_dir: Path
    seconds: float


def _steps_per_epoch(data: CachedDataset, cfg: Config, world: int) -> int:
    tc = cfg.train
    micro = len(data.epoch_batches(0, tc.batch_size, tc.seed)) // world
    return max(1, micro // tc.grad_accum)


def train(cfg: Config, paths: RunPaths, *, log=print) -> TrainResult:
    """Train a LoRA on the cached latents and text embeddings of ``paths``."""
    tc = cfg.train
    dist = engine.setup_distributed()
    torch.manual_seed(tc.seed)
    family = get_family(cfg.model)
    data = CachedDataset.from_run(paths)
    steps_per_epoch = _steps_per_epoch(data, cfg, dist.world_size)
    total = tc.max_steps or tc.epochs * steps_per_epoch
    epochs = -(-total // steps_per_epoch)

    denoiser = family.load_denoiser().to(engine.device())
    lora_cfg = adapter.peft_config(tc.lora, family.lora_targets(tc.lora.targets))
    params = adapter.add_lora(denoiser, lora_cfg)
    denoiser.train()
    optimizer = torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(total=total, warmup=tc.warmup_steps, kind=tc.lr_schedule)
    )
    model = engine.build_engine(denoiser, optimizer, scheduler, tc, dist.world_size)
    if dist.is_main:
        write_text_atomic(paths.train_dir / "config.yaml", yaml.safe_dump(cfg.model_dump(), sort_keys=False))
        n_train = sum(p.numel() for p in params)
        log(f"train: {len(data)} items, {steps_per_epoch} steps/epoch, {total} steps, "
            f"{n_train:,} trainable LoRA parameters, world size {dist.world_size}")

    metrics = MetricsWriter(paths.metrics, paths.tensorboard, enabled=dist.is_main)
    # Noise and timesteps differ per rank but are reproducible per (seed, rank).
    gen = torch.Generator(device=engine.device()).manual_seed(tc.seed * 1000 + dist.rank)
    meta = {"family": cfg.model.family, "flavor": cfg.model.flavor, "rank": tc.lora.rank, "alpha": tc.lora.alpha}
    step, t_start, losses = 0, time.perf_counter(), []
    for epoch in range(epochs):
        batches = data.epoch_batches(epoch, tc.batch_size, tc.seed)
        mine = batches[dist.rank :: dist.world_size][: steps_per_epoch * tc.grad_accum]
        for i in range(0, len(mine), tc.grad_accum):
            t0 = time.perf_counter()
            micro_losses = []
            for idx in mine[i : i + tc.grad_accum]:
                batch = data.collate(idx)
                latents = batch["latents"].to(model.device)
                text = {k: v.to(model.device) for k, v in batch["text"].items()}
                loss = family.loss(model, latents, text, gen).mean()
                model.backward(loss)
                model.step()
                micro_losses.append(loss.detach())
            step += 1
            step_loss = _mean_over_ranks(torch.stack(micro_losses).mean(), dist.world_size)
            losses.append(step_loss)
            dt = time.perf_counter() - t0
            grad_norm = model.get_global_grad_norm()
            metrics.log(
                step,
                epoch=epoch,
                loss=step_loss,
                lr=scheduler.get_last_lr()[0],
                grad_norm=float(grad_norm) if grad_norm is not None else None,
                samples_per_s=tc.batch_size * tc.grad_accum * dist.world_size / dt,
                step_time=dt,
            )
            if tc.checkpoint_every_steps and step % tc.checkpoint_every_steps == 0:
                _checkpoint(model, paths, step, epoch)
            if step >= total:
                break
        if dist.is_main and tc.save_every_epochs and (epoch + 1) % tc.save_every_epochs == 0:
            adapter.save_adapter(paths.epoch_loras / f"epoch-{epoch + 1:04d}", adapter.lora_state_dict(denoiser),
                                 lora_cfg, {**meta, "step": step, "epoch": epoch + 1})
        if step >= total:
            break

    _checkpoint(model, paths, step, epochs)
    metrics.close()
    if dist.is_main:
        adapter.save_adapter(paths.adapter_dir, adapter.lora_state_dict(denoiser), lora_cfg,
                             {**meta, "step": step, "epoch": epochs})
        plot_loss(read_metrics(paths.metrics), paths.train_dir / "loss.png")
    seconds = time.perf_counter() - t_start
    if dist.is_main:
        log(f"train: {step} steps in {seconds:.1f} s; loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return TrainResult(step, epochs, losses[0], losses[-1], paths.adapter_dir, seconds)


def _mean_over_ranks(value: torch.Tensor, world: int) -> float:
    if world > 1:
        value = value.clone()
        torch.distributed.all_reduce(value)
        value /= world
    return float(value)


def _checkpoint(model, paths: RunPaths, step: int, epoch: int) -> None:
    """Full DeepSpeed state (adapter, optimizer, scheduler) without the frozen base weights."""
    model.save_checkpoint(
        str(paths.checkpoints), tag=f"step-{step:06d}", client_state={"step": step, "epoch": epoch},
        exclude_frozen_parameters=True,
    )
