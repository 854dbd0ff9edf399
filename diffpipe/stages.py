"""The workflow's stages as functions, and what each reads from the config, declared once.

A stage's Snakemake rule reruns when the digest of its declared inputs changes
(:func:`stage_digest`), so a stage that read a key it does not declare would keep a
stale result after that key was edited. Each stage function therefore works on its own
typed part of the config (:mod:`diffpipe.stage_inputs`: ``PlanInputs`` for ``plan``, ...),
whose fields are the keys it may read, and :data:`STAGE_INPUTS` is made from those fields.

Entries are a whole section (``"cache"``) or one field of it (``"train.batch_size"``, or nested:
``"train.text_encoder.encoders"``).
``output_dir`` is always readable: every output path depends on it already.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from diffpipe.config import Config, ExportConfig
from diffpipe.data.dataset.discover import run_folders, vshard_names
from diffpipe.hub import check_local_model
from diffpipe.paths import RunPaths
from diffpipe.resolve import resolve
from diffpipe.stage_inputs import (
    CacheInputs,
    ExportInputs,
    PlanInputs,
    SampleInputs,
    ValidateInputs,
    declared_keys,
    sample_export_format,
)
from diffpipe.utils import digest, sha256_bytes, sha256_file, stat_stamp

if TYPE_CHECKING:
    from rich.console import Console

    from diffpipe.data.cache.plan import PlanResult
    from diffpipe.data.dataset.results import ValidationResult
    from diffpipe.data.dataset.vshards import ShardResult
    from diffpipe.export.api import ExportResult
    from diffpipe.report import ReportResult

# Rerun triggers: a stage reruns when one of these changes. The classes' fields say why each key is there.
STAGE_INPUTS: dict[str, tuple[str, ...]] = {
    "validate": declared_keys(ValidateInputs),
    "plan": declared_keys(PlanInputs),
    "cache": declared_keys(CacheInputs),
    # Training also reads `sample` (preview images during training) on purpose without
    # rerunning for it (see TRAIN_UNTRACKED), and `datasets` through the caches it reads.
    "train": ("model", "train"),
    "export": declared_keys(ExportInputs),
    "sample": declared_keys(SampleInputs),
    # The run report shows the sample prompts under the sample images; everything else it reads from the
    # run's files (the config training ran with, the exports, the metrics), which are its rule's inputs.
    "report": ("sample",),
    # The speed sweep trains the configured model on the datasets' bucket shapes (not part of `all`).
    "bench": ("model", "datasets", "train", "bench"),
}

#: Keys the train stage reads without rerunning when they change, and why.
TRAIN_UNTRACKED: dict[str, str] = {
    "sample": "prompts for preview images during training; editing them reruns only the sample rule",
    "datasets": "reach training through the cached shards (its inputs); recorded for resume checks",
    "validation": "recorded with the run's config for resume checks only",
    "cache": "recorded with the run's config for resume checks only",
    "export": "recorded with the run's config for resume checks only",
}


def stage_digest(cfg: Config, stage: str) -> str:
    """Digest of the config keys ``stage`` declares (its rule's rerun trigger); under ``train.memory: auto`` the
    train stage's holds the planned memory settings instead of ``train.gpu_memory``
    (:func:`diffpipe.memory_plan.digest_settings`)."""
    dumped = cfg.model_dump(mode="json")
    picked: dict[str, Any] = {}
    for entry in STAGE_INPUTS[stage]:
        value = dumped
        for part in entry.split("."):
            value = value[part]
        picked[entry] = value
    if "model" in picked:
        picked["model"] = _base_lora_keys(cfg, stage, picked["model"])
    if stage == "train" and cfg.train.memory == "auto":
        # deferred: sizes the model on the meta device (seconds), and only memory: auto asks (start-up time)
        from diffpipe.memory_plan import digest_settings

        # The plan's settings, not the budget: a card that keeps the plan keeps the run.
        picked["train"] = {**picked["train"], "gpu_memory": None, "memory_plan": digest_settings(cfg)}
    return digest(picked)[:16]


#: Stages that read ``model.base_loras`` (folded into the denoiser and the text encoders).
BASE_LORA_STAGES = ("train", "export", "sample", "bench")
#: Stages that read only the base LoRAs holding a text encoder's LoRA (the text keys and caches): a
#: denoiser-only base LoRA leaves them as they are.
TEXT_BASE_LORA_STAGES = ("plan", "cache")


def _base_lora_keys(cfg: Config, stage: str, model: dict[str, Any]) -> dict[str, Any]:
    """The model section as ``stage``'s digest sees it: the base LoRAs with their content digests for a stage
    that reads them (an edited file reruns, a renamed one with the same scale too, by path), none otherwise
    (and none when empty, so configs without base LoRAs keep their digests)."""
    model = {k: v for k, v in model.items() if k != "base_loras"}
    if stage not in BASE_LORA_STAGES + TEXT_BASE_LORA_STAGES or not cfg.model.base_loras:
        return model
    # deferred: hashing the files reads them; only configs with base LoRAs pay (start-up time: hub imports)
    from diffpipe.hub import file as hub_file
    from diffpipe.model_ids import split_file_id
    from diffpipe.training.base_loras import has_text_part

    found = []
    for b in cfg.model.base_loras:
        parts = split_file_id(b.path)
        path = Path(hub_file(*parts)) if parts else Path(b.path)
        if stage in TEXT_BASE_LORA_STAGES and not has_text_part(path):
            continue
        found.append({"path": b.path, "scale": b.scale, "content": _content_digest(path)})
    return {**model, "base_loras": found} if found else model



def _content_digest(path: Path) -> str:
    """A base LoRA's content digest; ``missing`` for a path that is not there (the train job says so)."""
    if path.is_dir():
        files = [*sorted(path.glob("adapter_*")), *sorted(path.glob("text_encoder*/adapter_*"))]
        return sha256_bytes("\n".join(_file_digest(f, *stat_stamp(f)) for f in files if f.is_file()).encode())
    return _file_digest(path, *stat_stamp(path)) if path.is_file() else "missing"


@functools.lru_cache(maxsize=64)
def _file_digest(path: Path, size: int, mtime_ns: int) -> str:
    """sha256 of ``path`` once per process while its size and mtime stay: each of the six stages that read base
    LoRAs asks for their digests, in the workflow's start and in every job, and a base LoRA can be gigabytes."""
    return sha256_file(path)


# -- the stages as functions ---------------------------------------------------------
# The CLI, the tests' helpers and the benchmarks call these, so each stage is wired
# once (arguments included). Given a whole Config (tests, benchmarks), a stage resolves it
# (a config parsed by diffpipe.config alone has a local model's family still to read) and
# keeps only its part. The libraries each stage calls are imported in its body for start-up
# time: the CLI and the Snakefile import this module, and they import torch or pyarrow.
_Part = TypeVar("_Part", ValidateInputs, PlanInputs, CacheInputs, SampleInputs)


def _part(cfg: Config | _Part, kind: type[_Part]) -> _Part:
    return kind.of(resolve(cfg)) if isinstance(cfg, Config) else cfg


def validate(cfg: Config | ValidateInputs, paths: RunPaths, *, rehash: bool = False, workers: int | None = None,
             tokens: bool = True, console: Console | None = None) -> ValidationResult:
    """Check every dataset file; write the manifest and the reports (``diffpipe validate``)."""
    # deferred: loads torch / diffusers (seconds); the CLI imports this module for every command
    from diffpipe.data.dataset.validate import run_validation
    from diffpipe.families.token_counter import FamilyTokenCounter

    cfg = _part(cfg, ValidateInputs)
    check_local_model(cfg.model)  # a missing or incomplete model folder fails here, before any file is read
    probes = tuple(paths.validate_probe(name) for name in vshard_names(cfg.validation.shards))
    return run_validation(cfg.datasets, cfg.validation, manifest_path=paths.manifest,
                          report_json=paths.report_json, report_html=paths.report_html, rehash=rehash,
                          tokens=FamilyTokenCounter(cfg.model) if tokens else None, workers=workers,
                          console=console, exclude=run_folders(cfg.output_dir, cfg.cache.dir), probes=probes)


def validate_shard(cfg: Config | ValidateInputs, paths: RunPaths, shard: str, *, rehash: bool = False,
                   workers: int | None = None, console: Console | None = None) -> ShardResult:
    """Probe one validation shard's files into its probe table (``diffpipe validate-shard``)."""
    # deferred: polars and the decoders (start-up time of every command)
    from diffpipe.data.dataset.vshards import run_shard

    cfg = _part(cfg, ValidateInputs)
    return run_shard(cfg.datasets, cfg.validation, shard=shard, shards=cfg.validation.shards,
                     out_path=paths.validate_probe(shard), exclude=run_folders(cfg.output_dir, cfg.cache.dir),
                     rehash=rehash, workers=workers, console=console, listing_path=paths.validate_listing(shard))


def plan(cfg: Config | PlanInputs, paths: RunPaths) -> PlanResult:
    """Assign the manifest's items to shards and write the shard specs (``diffpipe plan``)."""
    # deferred: loads torch / diffusers (seconds); the CLI imports this module for every command
    from diffpipe.data.cache.plan import make_plan
    from diffpipe.families import get_family
    from diffpipe.families.datasets import check_datasets_fit

    cfg = _part(cfg, PlanInputs)
    family = get_family(cfg.model).with_trained_text(cfg.train.text_encoder.encoders)
    if cfg.model.base_loras:
        from diffpipe.export.base_loras import text_base_loras  # deferred: the LoRA readers (start-up time)

        family = text_base_loras(family, paths.root)  # their text-encoder parts enter the text keys
    check_datasets_fit(family, cfg.datasets)
    return make_plan(paths.manifest, cfg.datasets, cfg.cache, latent_identity=family.vae_identity(),
                     text_identity=family.text_identity(), pixel_multiple=family.pixel_multiple, paths=paths,
                     global_batch=cfg.train.batch_size * cfg.train.grad_accum,
                     fps=family.fps, frame_rule=family.frame_rule, text_control=family.text_uses_control)


def cache_latents(cfg: Config | CacheInputs, paths: RunPaths, shard: str, *, regenerate: bool = False,
                  trust: bool = False) -> dict[str, Any]:
    """Build one latent shard (``diffpipe cache latents``); returns its summary."""
    # deferred: loads torch / diffusers (seconds); the CLI imports this module for every command
    from diffpipe.cache_jobs import cache_latents as build

    cfg = _part(cfg, CacheInputs)
    return build(paths.latent_spec(shard), paths.latent_shard(shard), cfg.model, cfg.cache,
                 store=paths.cache_store(cfg.cache.dir), regenerate=regenerate, trust=trust)


def cache_text(cfg: Config | CacheInputs, paths: RunPaths, shard: str, *, regenerate: bool = False) -> dict[str, Any]:
    """Build one text shard (``diffpipe cache text``); returns its summary."""
    # deferred: loads torch / diffusers (seconds); the CLI imports this module for every command
    from diffpipe.cache_jobs import cache_text as build

    cfg = _part(cfg, CacheInputs)
    return build(paths.text_spec(shard), paths.text_shard(shard), cfg.model, cfg.cache,
                 store=paths.cache_store(cfg.cache.dir), regenerate=regenerate,
                 trained_text=cfg.train.text_encoder.encoders, run_root=paths.root)


def cache_empty(cfg: Config | CacheInputs, paths: RunPaths, *, regenerate: bool = False) -> dict[str, Any]:
    """Encode the empty caption (``diffpipe cache empty``); returns its summary."""
    # deferred: loads torch / diffusers (seconds); the CLI imports this module for every command
    from diffpipe.cache_jobs import cache_empty_text

    cfg = _part(cfg, CacheInputs)
    return cache_empty_text(paths.text_empty, cfg.model, cfg.cache, spec_path=paths.empty_spec,
                            store=paths.cache_store(cfg.cache.dir), regenerate=regenerate,
                            trained_text=cfg.train.text_encoder.encoders, run_root=paths.root)


def export(target: Path | None, cfg: Config | None, *, formats: list[str] | None = None,
           out: Path | None = None) -> ExportResult:
    """Export the trained LoRA in ``formats`` (default: the config's) (``diffpipe export``).

    ``target``: a run folder, an adapter folder or a checkpoint (default: ``cfg``'s run); ``cfg``: a
    resolved config (default: the run's own). Without either config, an adapter's header names the
    base model (a tiny flavor) and the formats are the defaults.
    """
    # deferred: loads torch / diffusers (seconds); the CLI imports this module for every command
    from diffpipe.export import export_lora
    from diffpipe.export.locate import locate, model_config_from_adapter
    from diffpipe.families import get_family

    found = locate(target, ExportInputs.of(cfg) if cfg else None)
    part = ExportInputs.of(found.config) if isinstance(found.config, Config) else found.config
    model_cfg = part.model if part else model_config_from_adapter(found.adapter_dir)
    formats = formats or list((part.export if part else ExportConfig()).formats)
    return export_lora(found.adapter_dir, out or found.out_dir, get_family(model_cfg), formats, config=part,
                       run=found.run)


def sample(cfg: Config | SampleInputs, paths: RunPaths, *, lora: Path | None = None,
           out: Path | None = None) -> list[Path]:
    """Render the sample prompts with ``lora`` (default: the run's export that diffusers reads) (``diffpipe sample``)."""
    # deferred: loads torch / diffusers (seconds); the CLI imports this module for every command
    from diffpipe.training.sample import render_samples

    cfg = _part(cfg, SampleInputs)
    default = paths.export_file(sample_export_format(cfg.train.lora))
    bases = None
    if cfg.model.base_loras:
        # deferred: the LoRA readers import torch and diffusers (start-up time)
        from diffpipe.export.base_loras import prepare_base_loras
        from diffpipe.families import get_family

        family = get_family(cfg.model)
        bases = prepare_base_loras(family.cfg, family, paths.root)
    return render_samples(cfg.model, cfg.sample, lora or default, out or paths.samples_dir, base_loras=bases)


def report(cfg: Config | SampleInputs, paths: RunPaths, *, out: Path | None = None) -> ReportResult:
    """Write the run report, one self-contained HTML page (``diffpipe report``)."""
    # deferred: matplotlib and the family specs (seconds); the CLI imports this module for every command
    from diffpipe.families.sampling import sampling_note
    from diffpipe.report import build_report

    cfg = _part(cfg, SampleInputs)
    return build_report(paths, prompts=list(cfg.sample.prompts), sampling=sampling_note(cfg.model, cfg.sample),
                        out=out)


def prepare_data(cfg: Config, paths: RunPaths, *, empty_caption: bool = True) -> None:
    """validate, plan and every cache shard, in order, as the workflow runs them (tests, benchmarks)."""
    result = validate(cfg, paths, tokens=False)
    if result.errors:
        raise ValueError(f"validation found errors; see {paths.report_html}")
    plan(cfg, paths)
    for shard in paths.shard_names("latents"):
        cache_latents(cfg, paths, shard)
    for shard in paths.shard_names("text"):
        cache_text(cfg, paths, shard)
    if empty_caption:
        cache_empty(cfg, paths)
