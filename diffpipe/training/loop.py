"""The training loop (:class:`Trainer`): setup, (resume), step, log, checkpoint, save. Reads only the caches."""

from __future__ import annotations

import contextlib
import math
import shutil
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import yaml

from diffpipe.config import Config, ObjectiveConfig, TrainConfig
from diffpipe.data.cache.reader import CachedDataset
from diffpipe.families import get_family
from diffpipe.models import _common as common
from diffpipe.models.routing import TokenRoute, route_generator
from diffpipe.paths import RunPaths
from diffpipe.progress import Progress
from diffpipe.training import base_loras, checkpointing, engine, finite, load, offload, pipeline, precision
from diffpipe.training import checkpoint as ckpt
from diffpipe.training import resume as resuming
from diffpipe.training.ema import STATE_NAME as EMA_STATE
from diffpipe.training.ema import Ema
from diffpipe.training.eval import Evaluator, aux_inputs, eval_dataset
from diffpipe.training.flops import StepFlops
from diffpipe.training.in_backward import InBackward
from diffpipe.training.metrics import MetricsWriter, peak_memory_mb, read_metrics
from diffpipe.training.optim import build_training_optimizer
from diffpipe.training.options import training_options
from diffpipe.training.plots import plot_loss
from diffpipe.training.profiling import StepProfiler
from diffpipe.training.sample import TrainingSampler
from diffpipe.training.schedules import lr_lambda
from diffpipe.training.trainable import Trainable
from diffpipe.utils import stable_json, write_text_atomic


@dataclass
class TrainResult:
    steps: int
    epochs: int
    first_loss: float
    last_loss: float
    adapter_dir: Path
    seconds: float
    resumed_from: int = 0
    skipped_steps: int = 0  # optimizer steps skipped for a loss or gradients that were not finite


class DataOrder:
    """Which micro-batches each rank trains on at each optimizer step.

    The order depends only on (seed, epoch, rank, world size), so a resumed
    run picks up at exactly the batch an uninterrupted run would be at.
    """

    def __init__(self, data: CachedDataset, tc: TrainConfig, rank: int, world_size: int):
        self.data, self.tc, self.rank, self.world = data, tc, rank, world_size
        micro = len(data.epoch_batches(0, tc.batch_size, tc.seed)) // world_size
        self.steps_per_epoch = max(1, micro // tc.grad_accum)
        self.total = tc.max_steps or tc.epochs * self.steps_per_epoch
        self.epochs = -(-self.total // self.steps_per_epoch)

    @lru_cache(maxsize=2)  # noqa: B019  (one DataOrder per run)
    def _mine(self, epoch: int) -> list[list[int]]:
        batches = self.data.epoch_batches(epoch, self.tc.batch_size, self.tc.seed)
        return batches[self.rank :: self.world]

    def micro_batches(self, step: int) -> list[list[int]]:
        """Micro-batches (item indices) of 0-based optimizer step ``step`` on this rank."""
        epoch, i = divmod(step, self.steps_per_epoch)
        mine, ga = self._mine(epoch), self.tc.grad_accum
        # Fewer batches than ranks x accumulation: reuse this rank's batches cyclically.
        return [mine[(i * ga + j) % len(mine)] for j in range(ga)]


def train(cfg: Config, paths: RunPaths, *, resume: bool = False, checkpoint: str | None = None,
          log=print, data: CachedDataset | None = None, auto_resume: bool = False,
          memory_plan: dict[str, Any] | None = None) -> TrainResult:
    """Train a LoRA (or, with ``train.mode: full``, the whole denoiser) on the caches of ``paths``.

    ``resume`` continues from the latest checkpoint (or ``checkpoint``, a
    name under ``train/checkpoints`` or a path) with identical results.
    ``auto_resume`` does so when the latest checkpoint fits this config, data and
    process count, and starts at step 1 otherwise (the workflow's train job).
    ``data`` trains on that dataset instead of the run's caches (``diffpipe bench``'s synthetic batches).
    ``memory_plan``: the ``train.memory: auto`` plan ``cfg`` already carries, for ``summary.json``.
    """
    return Trainer(cfg, paths, resume=resume, checkpoint=checkpoint, log=log, data=data,
                   auto_resume=auto_resume, memory_plan=memory_plan).run()


class Trainer:
    """One training run: named setup steps (:meth:`setup_data`, :meth:`setup_model`, :meth:`restore`,
    :meth:`setup_monitors`), then :meth:`step` per optimizer step and :meth:`finish`."""

    def __init__(self, cfg: Config, paths: RunPaths, *, resume: bool = False, checkpoint: str | None = None,
                 log=print, data: CachedDataset | None = None, auto_resume: bool = False,
                 memory_plan: dict[str, Any] | None = None):
        self.cfg, self.tc, self.paths, self.log = cfg, cfg.train, paths, log
        self.resume, self.checkpoint, self.data, self.own_data = resume, checkpoint, data, data is None
        self.auto_resume, self.memory_plan = auto_resume, memory_plan

    def run(self) -> TrainResult:
        self.setup_data()
        self.setup_model()
        start = self.restore()
        self.setup_monitors(start)
        self.last_saved, self.t_start, self.losses = start, time.perf_counter(), []
        with self.progress:  # an exception records the job as failed for `diffpipe status`
            for step in range(start, self.order.total):
                self.step(step)
            return self.finish(start)

    # -- setup ---------------------------------------------------------------------------
    def setup_data(self) -> None:
        """Processes, the family, the dataset and each rank's batch order; the checks that need them."""
        tc = self.tc
        precision.check(tc)
        self.dist = dist = engine.setup_distributed()
        torch.manual_seed(tc.seed)
        self.family = family = get_family(self.cfg.model).with_trained_text(tc.text_encoder.encoders)
        self.base_folders = self._base_folders()
        # Their text-encoder parts: in every text encoder loaded (trained ones, in-training samples).
        self.family = family = base_loras.with_base_text(family, self.base_folders)
        self.data = data = CachedDataset.from_run(self.paths) if self.own_data else self.data
        if dist.world_size % tc.pipeline_stages:
            raise ValueError(f"train.pipeline_stages {tc.pipeline_stages} does not divide the {dist.world_size} "
                             "processes")
        # Pipeline stages of one replica see the same data; replicas (data parallel) differ.
        dp_world = dist.world_size // tc.pipeline_stages
        self.dp_rank = dist.rank % dp_world  # DeepSpeed's pipe x data topology: data is the fastest axis
        self.order = DataOrder(data, tc, self.dp_rank, dp_world)
        if tc.caption_dropout and data.empty_text is None:
            raise ValueError(f"train.caption_dropout needs the empty-caption cache {self.paths.text_empty}; "
                             "run the workflow's empty-caption cache job (or set caption_dropout: 0)")
        if tc.caption_dropout and family.text_uses_control:
            raise ValueError(f"train.caption_dropout: model family {family.name!r} encodes each caption with its "
                             "control image, so one cached empty caption cannot stand in; set caption_dropout: 0")
        _check_aux(family, data, tc, self.log if dist.is_main else (lambda *_: None))
        family.check_token_routing(tc.token_routing)
        self.items = _data_items(data)
        self.run_meta = {"config": self.cfg.model_dump(mode="json"), "world_size": dist.world_size,
                         "data_digest": ckpt.items_digest(self.items)}
        # Refused early, before any model is loaded.
        if self.resume or self.checkpoint:
            self.resume_from = resuming.check_resume(self.paths, self.run_meta, self.items, self.checkpoint)
        elif self.auto_resume:
            self.resume_from = resuming.fitting_checkpoint(self.paths, self.run_meta, self.items,
                                                   self.log if dist.is_main else (lambda *_: None))
        else:
            self.resume_from = None

    def _base_folders(self) -> list[tuple[Path, float]]:
        """``model.base_loras`` as the train job read them into the run folder: ``(folder, scale)`` each."""
        bases = self.family.cfg.base_loras  # hub ids resolved to their cached files
        folders = [(base_loras.adapter_dir(self.paths.root, b.path), b.scale) for b in bases]
        unread = [str(f) for f, _ in folders if not f.is_dir()]
        if unread:
            raise ValueError(f"model.base_loras: not read into the run folder yet ({unread[0]}); train through "
                             "`diffpipe train`, which reads them first")
        return folders

    def _base_loras(self) -> base_loras.BaseDeltas | None:
        """The base LoRAs' denoiser parts, to fold as the denoiser loads (None: there are none)."""
        if not self.base_folders:
            return None
        if self.dist.is_main:
            texts = f"; text encoder(s) {', '.join(self.family.base_text)} too" if self.family.base_text else ""
            self.log(f"train: {len(self.base_folders)} base LoRA(s) folded into the frozen denoiser{texts} "
                     "(left out of the export)")
        return base_loras.BaseDeltas.read(self.base_folders)

    def setup_model(self) -> None:
        """The denoiser with its trainable parameters, precision options, the DeepSpeed engine (plain or
        pipeline), block swap, and the noise generator."""
        tc, dist, family = self.tc, self.dist, self.family
        # Streamed where it can be: quantised and placed as read, swapped blocks kept in host memory.
        loaded = load.load_denoiser(family, tc, engine.device(), base=self._base_loras())
        if dist.is_main:
            self.log(f"train: denoiser {loaded.note}")
        self.denoiser = denoiser = loaded.module
        self.load_note = loaded.note
        self.swap: offload.BlockSwap | None = None
        # The swapped blocks' weights stay out of the model (and off the GPU) until the engine is built.
        held = offload.hold(denoiser, tc.block_swap, engine.device()) if loaded.streamed else None
        if tc.base_weights == "auto":
            denoiser.to(engine.device())
        with load.quiet_lora():
            self.trained = trained = Trainable(denoiser, family, self.cfg, is_main=dist.is_main,
                                               continue_lora=self.resume_from is None)
        # fp8 base weights (unless quantised as read), attention backend, compile
        precision.prepare_denoiser(denoiser, tc, quantise=not loaded.quantised)
        # 8-bit base weights are stored while the denoiser is still in CPU memory: the GPU never holds its
        # 16-bit copy (FLUX.1-dev's 22 GiB would not fit a 24 GB card before fp8 / int8 halved it).
        denoiser.to(engine.device())
        self.params = trained.all_params

        def make_scheduler(optimizer):
            scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer, lr_lambda(total=self.order.total, warmup=tc.warmup_steps, kind=tc.lr_schedule))
            # After the scheduler: it wraps optimizer.step itself, and must wrap the real method.
            self.guard = finite.StepGuard(optimizer)
            return scheduler

        if tc.pipeline_stages > 1:
            layers = family.pipeline_layers(denoiser)
            self.model, trained.stage_params = pipeline.build_pipeline_engine(
                layers, pipeline.stage_bounds(layers, tc), pipeline.pipeline_loss_fn(tc.objective), tc,
                dist.world_size, make_scheduler)
        else:
            if tc.optimizer_in_backward and precision.resolve_precision(tc.precision) == "bf16":
                # No DeepSpeed bf16 mode here (engine.deepspeed_config): the weights are cast, and stay, in bf16.
                trained.training_module().to(torch.bfloat16)
            optimizer = build_training_optimizer(trained.param_groups(), tc)
            self.model = engine.build_engine(trained.training_module(), optimizer, make_scheduler(optimizer), tc,
                                             dist.world_size)
            # After DeepSpeed moved and cast the module.
            self.swap = offload.install(denoiser, tc.block_swap, engine.device(), held=held)
        self.scheduler = self.model.lr_scheduler
        self.ema = Ema(self.params, tc.ema) if tc.ema.enabled else None
        # Noise and timesteps differ per replica but are reproducible per (seed, replica).
        self.gen = torch.Generator(device=engine.device()).manual_seed(tc.seed * 1000 + self.dp_rank)

    def memory_options(self) -> dict[str, Any]:
        """Every memory setting as it took effect (``auto`` resolved, ``block_swap`` as the blocks swapped of
        those there are, how the denoiser was loaded), for the start of the log and ``summary.json``."""
        tc = self.tc
        options: dict[str, Any] = {
            "precision": precision.resolve_precision(tc.precision), "base_weights": tc.base_weights,
            "activation_checkpointing": tc.activation_checkpointing,
            "checkpoint_fraction": tc.checkpoint_fraction if tc.activation_checkpointing else None,
            "block_swap": f"{len(self.swap.blocks)} of {len(offload.swap_blocks(self.denoiser))} blocks"
            if self.swap else 0,
            "activation_offload": tc.activation_offload, "zero_stage": tc.zero_stage,
            "zero_offload": engine.offload_in_effect(self.model), "attention_backend": tc.attention_backend,
            "compile": tc.compile, "denoiser_load": self.load_note,
        }
        return options

    def restore(self) -> int:
        """Resume from the checkpoint asked for, or record the run's config; returns the first step."""
        dist, paths = self.dist, self.paths
        start = 0
        self.streak = finite.Streak(self.tc.max_nonfinite_steps)
        if self.resume_from is not None:
            start = resuming.resume(self.model, self.gen, paths, self.resume_from, dist.rank, dist.world_size)
            self.streak.load(ckpt.read_meta(self.resume_from).get("nonfinite", {}))
            if self.ema is not None:
                self.ema.load(self.resume_from / EMA_STATE)
            if dist.is_main:
                self.log(f"train: resumed from step {start} ({paths.checkpoints})")
        elif dist.is_main:
            write_text_atomic(paths.train_dir / "config.yaml", yaml.safe_dump(self.cfg.model_dump(), sort_keys=False))
        if dist.is_main:
            n_params = sum(getattr(p, "ds_numel", p.numel()) for p in self.params)  # ZeRO-3 leaves p empty here
            self.log(f"train: {len(self.data)} items, {self.order.steps_per_epoch} steps/epoch, {self.order.total} "
                     f"steps, {n_params:,} trainable parameters ({self.trained.kind}), world size {dist.world_size}")
            self.log("train: options in effect: "
                     + ", ".join(f"{k} {v}" for k, v in training_options(self.cfg, self.memory_plan).items()))
            self.log("train: memory options in effect: "
                     + ", ".join(f"{k} {v}" for k, v in self.memory_options().items()))
        return start

    def setup_monitors(self, start: int) -> None:
        """Metrics and trackers, the evaluator (and its baseline at step 0), checkpoint trigger, sampler,
        FLOP counter and profiler."""
        tc, dist, paths, cfg = self.tc, self.dist, self.paths, self.cfg
        self.metrics = MetricsWriter(paths.metrics, paths.tensorboard, enabled=dist.is_main, append=start > 0,
                                     purge_step=start + 1 if start else None, trackers=tc.trackers,
                                     project=tc.tracker_project, run_name=tc.run_name,
                                     config=cfg.model_dump(mode="json"))
        self.evaluate = Evaluator(self.family, eval_dataset(paths, self.data) if self.own_data else self.data,
                                  tc.eval, batch_size=tc.batch_size, device=self.model.device)
        if start == 0 and self.memory_plan is not None:  # train.memory: auto's choice, first in metrics.jsonl
            self.metrics.log(0, memory_plan=self.memory_plan)
        if start == 0:  # the baseline later evals compare with (TensorBoard only: rows are steps)
            self.metrics.log(0, jsonl=False, **self.evaluate(self.model))
        self.trigger = resuming.CheckpointTrigger(tc, paths, dist.world_size, dist.is_main)
        self.sampler = TrainingSampler(self.family, cfg.sample, self.denoiser, paths.train_dir / "samples",
                                       text_encoders=self.trained.text.modules if self.trained.text else None)
        self.samples_per_step = tc.batch_size * tc.grad_accum * dist.world_size
        self.flops = StepFlops(tc, self.model.device)
        self.profiler = StepProfiler(tc.profile, paths.train_dir / "profile", enabled=dist.is_main, rank=dist.rank)
        # Rank 0 reports for the run: its status file (diffpipe status, diffpipe run) and progress lines.
        self.progress = Progress(paths.root if dist.is_main else None, "train", stage="train", total=self.order.total,
                                 start=start, samples_per_unit=self.samples_per_step, log=self.log,
                                 display="auto" if dist.is_main else "none")

    # -- the loop ---------------------------------------------------------------------------
    def save_checkpoint(self, step: int) -> Path:
        self.check_weights(step, f"checkpoint {ckpt.checkpoint_name(step)}")
        epoch, in_epoch = divmod(step, self.order.steps_per_epoch)
        trained = self.trained
        # The LoRA goes in as an adapter folder too (for export); full weights live in DeepSpeed's files.
        # The EMA state goes beside it (every rank holds the same average: rank 0 writes it).
        def write_adapter(folder: Path) -> None:
            if not trained.full:
                trained.save(folder, step=step, epoch=epoch)
            if self.ema is not None and self.dist.is_main:
                self.ema.save(folder.parent / EMA_STATE)
            if self.dist.is_main and self.paths.metrics.is_file():
                # The loss history so far: Snakemake deletes metrics.jsonl before it reruns an interrupted job.
                shutil.copyfile(self.paths.metrics, folder.parent / resuming.METRICS_COPY)

        return ckpt.save_checkpoint(
            self.model, self.paths.checkpoints, step=step, rank=self.dist.rank, keep_last=self.tc.keep_checkpoints,
            meta={**self.run_meta, "epoch": epoch, "step_in_epoch": in_epoch, "nonfinite": self.streak.state()},
            rng=ckpt.rng_state(self.gen), write_adapter=write_adapter, data_items=self.items,
        )

    def check_weights(self, step: int, what: str) -> None:
        """Refuse to write ``what`` when a trained weight is not finite on any rank (collective), naming them."""
        local = [getattr(p, "ds_tensor", p) for p in self.params]  # ZeRO-3: this rank's partition
        ok = finite.all_finite(local)
        if engine.any_over_ranks(not ok, self.dist.world_size):
            names = {id(p): n for n, p in self.trained.training_module().named_parameters()}
            bad = finite.nonfinite_names((names.get(id(p), "?"), t) for p, t in zip(self.params, local, strict=True))
            found = ckpt.list_checkpoints(self.paths.checkpoints)
            raise finite.NonFiniteError(
                f"train: step {step}: {len(bad) or 'some'} trained tensor(s) hold NaN or inf values"
                f"{': ' + finite.describe(bad) if bad else ' (on another process)'}; {what} was not written. "
                "Training diverged: lower train.lr or keep train.grad_clip on. "
                + (f"The newest checkpoint, {found[-1]}, is untouched." if found else "This run wrote no checkpoint."))

    def step(self, step: int) -> None:
        """One optimizer step (skipped when its loss or gradients are not finite), its metrics (and evals when
        due), per-epoch LoRA, samples and checkpoint."""
        tc, order, data, model = self.tc, self.order, self.data, self.model
        done, epoch = step + 1, step // order.steps_per_epoch
        t0 = time.perf_counter()
        micro = order.micro_batches(step)
        with self.flops.step(tuple(data.items[idx[0]].bucket for idx in micro)):  # counted once per shape
            if tc.pipeline_stages > 1:
                loss, grad_norm = _pipeline_step(model, self.family, data, micro, self.gen, tc.caption_dropout,
                                                 tc.objective, epoch)
                step_loss, split = engine.mean_over_ranks(loss, self.dist.world_size), {}
            else:
                step_loss, grad_norm, split = _train_step(model, self.family, data, micro, self.gen, self.params,
                                                          tc.caption_dropout, tc.objective, epoch,
                                                          offload_activations=tc.activation_offload,
                                                          guard=self.guard, world_size=self.dist.world_size,
                                                          routes=self._routes(step, len(micro)))
        # Skipped by the guard or by DeepSpeed's own overflow check; every rank counts the same steps.
        skipped = engine.any_over_ranks(self.guard.take() or not model.was_step_applied()
                                        or not math.isfinite(step_loss), self.dist.world_size)
        if self.ema is not None and not skipped:
            self.ema.update(done)
        dt = time.perf_counter() - t0
        self.losses.append(step_loss)
        due = done == order.total or (tc.eval.every_steps and done % tc.eval.every_steps == 0)
        evals = self.evaluate(model) if due else {}
        memory = peak_memory_mb(model.device)
        self.metrics.log(done, epoch=epoch, loss=step_loss, lr=float(self.scheduler.get_last_lr()[0]), grad_norm=grad_norm,
                         samples_per_s=self.samples_per_step / dt, step_time=dt,
                         peak_memory_mb=memory, elapsed_s=time.perf_counter() - self.t_start,
                         skipped_steps=self.streak.total + skipped, **self.flops.fields(dt), **evals,
                         **self._split_losses(split))
        self.progress.update(done, loss=step_loss, last_eval=evals.get("eval_loss"),
                             gpu_mem_mb=memory if model.device.type == "cuda" else None)
        self.profiler.step()
        self.streak.record(done, skipped, loss=step_loss, grad_norm=grad_norm, log=self.log if self.dist.is_main
                           else lambda *_: None, last_checkpoint=resuming.newest(self.paths.checkpoints) if skipped else None)
        epoch_end = done % order.steps_per_epoch == 0
        if epoch_end and not self.trained.full and tc.save_every_epochs and (epoch + 1) % tc.save_every_epochs == 0:
            self.check_weights(done, f"the epoch {epoch + 1} LoRA")
            self.trained.save(self.paths.epoch_loras / f"epoch-{epoch + 1:04d}", step=done, epoch=epoch + 1)
        if self.dist.is_main and _sample_due(tc, done, epoch_end, epoch):
            with self.ema.applied() if self.ema is not None and tc.ema.samples else contextlib.nullcontext():
                self.metrics.image("samples", self.sampler(done)[1], done)
        ckpt.fault_point("after-step", done)
        if self.trigger.due(done):
            if self.streak.in_a_row:  # the weights are those of the last good step: its checkpoint stays newest
                if self.dist.is_main:
                    self.log(f"train: step {done}: checkpoint put off (the step was skipped)")
            else:
                self.save_checkpoint(done)
                self.trigger.saved()
                self.last_saved = done

    def _routes(self, step: int, micro: int) -> list[TokenRoute] | None:
        """Each micro-batch's token routing (``train.token_routing``), drawn from the step: resume is exact."""
        r = self.tc.token_routing
        if r is None or r.keep >= 1:
            return None
        return [TokenRoute(r.keep, r.start_block, r.end_block, route_generator(self.tc.seed, step, self.dp_rank, i))
                for i in range(micro)]

    def _split_losses(self, split: dict[str, torch.Tensor]) -> dict[str, float]:
        """``loss_train`` / ``loss_reg``: the step's mean unweighted loss of each role's items over every rank
        (only when the data has regularisation items or loss weights; a role with no item this step is left out)."""
        if not self.data.has_loss_weights:
            return {}
        out = {}
        for name, losses in split.items():  # every rank reduces both, in the same order
            total = torch.stack([losses.sum(), torch.tensor(float(losses.numel()), device=losses.device)])
            if self.dist.world_size > 1:
                torch.distributed.all_reduce(total)
            if total[1] > 0:
                out[name] = float(total[0] / total[1])
        return out

    def finish(self, start: int) -> TrainResult:
        """The last checkpoint, the trained adapter (or denoiser), the loss plot and the run summary."""
        order, dist, paths, trained, losses = self.order, self.dist, self.paths, self.trained, self.losses
        self.profiler.close()
        if self.last_saved != order.total or not ckpt.list_checkpoints(paths.checkpoints):
            self.save_checkpoint(order.total)
        self.metrics.close()
        out = trained.output_dir(paths)
        self.check_weights(order.total, f"the trained {trained.kind}")
        if self.ema is None:
            trained.save(out, step=order.total, epoch=order.epochs)
        else:  # the average and the raw weights: one is the run's adapter, the other beside it
            ema_out = self.tc.ema.output == "ema"
            raw_dir, ema_dir = (paths.train_dir / "adapter_raw", out) if ema_out else (out, paths.train_dir / "adapter_ema")
            trained.save(raw_dir, step=order.total, epoch=order.epochs)
            with self.ema.applied():
                trained.save(ema_dir, step=order.total, epoch=order.epochs, ema_decay=self.tc.ema.decay)
        agree = trained.ranks_agree(dist.world_size)
        seconds = time.perf_counter() - self.t_start
        if dist.is_main:
            plot_loss(read_metrics(paths.metrics), paths.loss_plot, objective=self.tc.objective.loss)
            summary = {"steps": order.total, "resumed_from": start, "world_size": dist.world_size,
                       "ranks_agree": agree, "seconds": seconds, "offload": engine.offload_in_effect(self.model),
                       "skipped_steps": self.streak.total, "memory": self.memory_options(),
                       "options": training_options(self.cfg, self.memory_plan)}
            if self.memory_plan is not None:
                summary["memory_plan"] = self.memory_plan
            write_text_atomic(paths.train_dir / "summary.json", stable_json(summary))
            if losses:
                self.log(f"train: {len(losses)} steps in {seconds:.1f} s; loss {losses[0]:.4f} -> {losses[-1]:.4f}")
        first, last = (losses[0], losses[-1]) if losses else (math.nan, math.nan)
        return TrainResult(order.total, order.epochs, first, last, trained.output_dir(paths), seconds, start,
                           self.streak.total)


def _train_step(model, family, data: CachedDataset, micro_batches: list[list[int]], gen: torch.Generator,
                params: list[torch.nn.Parameter], caption_dropout: float,
                objective: ObjectiveConfig, epoch: int = 0, *,
                offload_activations: bool = False, guard: finite.StepGuard | None = None,
                world_size: int = 1, routes: list[TokenRoute] | None = None) -> tuple[float, float | None, dict]:
    """One optimizer step over ``grad_accum`` micro-batches; DeepSpeed steps at the boundary.
    ``offload_activations``: the forward's saved tensors wait in CPU memory (``train.activation_offload``).
    ``guard``: told to skip the step when its loss, averaged over the ``world_size`` ranks, is not finite.
    ``routes``: each micro-batch's token routing (``train.token_routing``; None: every token).

    Returns the mean loss over the micro-batches and ranks, and the gradient norm before clipping.
    """
    micro_losses, norm, step_loss = [], None, math.nan
    parts: dict[str, list[torch.Tensor]] = {"loss_train": [], "loss_reg": []}
    for i, idx in enumerate(micro_batches):
        batch = data.collate(idx, epoch)
        latents = batch["latents"].to(model.device)
        text = {k: v.to(model.device) for k, v in batch["text"].items()}
        if caption_dropout:
            text = _drop_captions(text, data.empty_text, caption_dropout, gen)
        with checkpointing.offloaded_saves(offload_activations):
            per_sample = family.loss(model, latents, text, gen, objective=objective,
                                     route=routes[i] if routes else None, **aux_inputs(family, batch, model.device))
        loss = weighted_loss(per_sample, batch, parts)
        stepping = _in_backward(model)
        if stepping is not None:  # the weights change during this backward pass: a loss that is not finite
            stepping.skip = not math.isfinite(float(loss.detach()))  # must stop it before, not after
        model.backward(loss)
        micro_losses.append(loss.detach())
        if model.is_gradient_accumulation_boundary():
            # The same value on every rank, so all of them skip together (or none does).
            step_loss = engine.mean_over_ranks(torch.stack(micro_losses).mean(), world_size)
            if guard is not None:
                guard.skip_next = not math.isfinite(step_loss)
            if stepping is not None:
                norm, nonfinite_grads = stepping.take()
                if guard is not None:
                    guard.skip_next = guard.skip_next or nonfinite_grads
            elif model.zero_optimization_stage() == 0:
                # Without ZeRO, DeepSpeed reports no norm; grads are all-reduced by now.
                norm = float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
        model.step()
    ds_norm = model.get_global_grad_norm()
    split = {k: torch.cat(v) if v else torch.zeros(0, device=model.device) for k, v in parts.items()}
    return step_loss, float(ds_norm) if ds_norm is not None else norm, split


def _in_backward(model) -> InBackward | None:
    """The engine's optimizer when it steps inside the backward pass (``train.optimizer_in_backward``)."""
    opt = getattr(model, "optimizer", None)
    return opt if isinstance(opt, InBackward) else None


def weighted_loss(per_sample: torch.Tensor, batch: dict[str, Any], parts: dict[str, list[torch.Tensor]]
                  ) -> torch.Tensor:
    """The batch's loss: the mean of each item's loss times its dataset's ``loss_weight``. With
    regularisation items or weights in the batch, their unweighted losses go to ``parts`` (``loss_train``,
    ``loss_reg``) for logging."""
    weights = batch.get("loss_weights")
    if weights is None:
        return per_sample.mean()
    weights, reg = weights.to(per_sample.device), batch["regularization"].to(per_sample.device)
    parts["loss_train"].append(per_sample[~reg].detach().float())
    parts["loss_reg"].append(per_sample[reg].detach().float())
    return (per_sample * weights).mean()


def _check_aux(family, data: CachedDataset, tc: TrainConfig, log) -> None:
    """Refuse aux data the run cannot use; say when cached control images go unused."""
    if data.has_masks and tc.pipeline_stages > 1:
        raise ValueError("loss masks (datasets[].mask_path / mask_column) need train.pipeline_stages: 1")
    if data.has_loss_weights and tc.pipeline_stages > 1:
        raise ValueError("datasets[].loss_weight / role: regularization need train.pipeline_stages: 1 (the last "
                         "stage's loss sees no per-item weights)")
    if family.uses_control and not data.has_controls:
        raise ValueError(f"model family {family.name!r} needs a control image per item: set "
                         "datasets[].control_path or control_column")
    if data.has_controls and not family.uses_control:
        log(f"train: note: model family {family.name!r} does not condition on control images; "
            "the cached control latents are not used")


def _sample_due(tc: TrainConfig, done: int, epoch_end: bool, epoch: int) -> bool:
    by_steps = tc.sample_every_steps and done % tc.sample_every_steps == 0
    by_epochs = epoch_end and tc.sample_every_epochs and (epoch + 1) % tc.sample_every_epochs == 0
    return bool(by_steps or by_epochs)


def _pipeline_step(model, family, data: CachedDataset, micro_batches: list[list[int]], gen: torch.Generator,
                   caption_dropout: float, objective: ObjectiveConfig, epoch: int = 0
                   ) -> tuple[torch.Tensor, float | None]:
    """One optimizer step through the pipeline. The first and last stage each read the micro-batches,
    drawing the same noise from the same generator state; the target reaches the last stage as a label."""

    dtype = common.param_dtype(model)  # the stage's weights' (bf16 under train.precision bf16)

    def feed():
        for idx in micro_batches:
            batch = data.collate(idx, epoch)
            text = {k: v.to(model.device) for k, v in batch["text"].items()}
            if caption_dropout:
                text = _drop_captions(text, data.empty_text, caption_dropout, gen)
            # Masks are refused under pipeline stages (_check_aux): what is left is SDXL's sizes.
            yield family.pipeline_inputs(batch["latents"].to(model.device), text, gen, objective, dtype,
                                         **aux_inputs(family, batch, model.device))

    loss = model.train_batch(data_iter=feed())
    norm = model.get_global_grad_norm()
    return loss.detach().float(), float(norm) if norm is not None else None


def _drop_captions(text: dict[str, torch.Tensor], empty: dict[str, torch.Tensor], p: float,
                   gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Swap each item's text for the cached empty caption with probability ``p``."""
    drop = torch.rand(next(iter(text.values())).shape[0], generator=gen, device=gen.device) < p
    out = {}
    for name, t in text.items():
        t = t.clone()
        t[drop.to(t.device)] = empty[name][0].to(device=t.device, dtype=t.dtype)
        out[name] = t
    return out


def _data_items(data: CachedDataset) -> dict[str, dict[str, Any]]:
    """What the resume check compares: each training item's cache keys (content), bucket and repeats."""
    return {it.id: {"path": it.path, "bucket": it.bucket, "repeats": it.repeats, "image": it.key,
                    "caption": it.text_key} for it in data.items}
