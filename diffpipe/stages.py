"""What each workflow stage reads from the config, declared once.

A stage's Snakemake rule reruns when the digest of its declared inputs changes
(``workflow.stage_digest``), so a stage that read a key it does not declare
would keep a stale result after that key was edited. The CLI therefore hands
each stage a :class:`ConfigView` that exposes only the declared keys: reading
any other key fails at once (and in the test suite, which runs every stage),
instead of silently leaving a result stale.

Entries are a whole section (``"cache"``) or one field of it (``"train.batch_size"``, or nested:
``"train.text_encoder.encoders"``).
``output_dir`` is always readable: every output path depends on it already.
"""

from __future__ import annotations

from typing import Any

from diffpipe.config import Config
from diffpipe.resolve import resolve
from diffpipe.utils import digest

# Rerun triggers: a stage reruns when one of these changes.
STAGE_INPUTS: dict[str, tuple[str, ...]] = {
    # cache.dir: the cache folder is kept out of dataset discovery.
    "validate": ("datasets", "validation", "model", "cache.dir"),
    # train.batch_size and grad_accum: buckets smaller than one global batch are filled by repetition.
    # train.text_encoder: a trained text encoder's captions are cached as token ids (other keys).
    "plan": ("datasets", "validation", "cache", "model", "train.batch_size", "train.grad_accum",
             "train.text_encoder.encoders"),
    "cache": ("model", "cache", "train.text_encoder.encoders"),
    # Training also reads `sample` (preview images during training) on purpose without
    # rerunning for it (see TRAIN_UNTRACKED), and `datasets` through the caches it reads.
    "train": ("model", "train"),
    # train.lora: the adapter's settings when a checkpoint (not an adapter folder) is exported.
    "export": ("model", "export", "train.lora"),
    # train.lora: its kind picks the export samples load (LoKr/LoHa: the PEFT folder).
    "sample": ("model", "sample", "train.lora"),
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


class UndeclaredConfigRead(RuntimeError):
    """A stage read a config key it does not declare in STAGE_INPUTS (a bug: its reruns would miss edits)."""


def _split(entries: tuple[str, ...]) -> tuple[set[str], dict[str, set[str]]]:
    whole = {e for e in entries if "." not in e}
    fields: dict[str, set[str]] = {}
    for e in entries:
        if "." in e:
            section, field = e.split(".", 1)
            fields.setdefault(section, set()).add(field)
    return whole, fields


def declared(stage: str) -> tuple[str, ...]:
    return STAGE_INPUTS[stage]


def stage_digest(cfg: Config, stage: str) -> str:
    """Digest of the config keys ``stage`` declares (its rule's rerun trigger)."""
    dumped = cfg.model_dump(mode="json")
    picked: dict[str, Any] = {}
    for entry in STAGE_INPUTS[stage]:
        value = dumped
        for part in entry.split("."):
            value = value[part]
        picked[entry] = value
    return digest(picked)[:16]


class _SectionView:
    """One config section, restricted to the fields a stage declares."""

    def __init__(self, section: Any, name: str, fields: set[str], stage: str):
        object.__setattr__(self, "_section", section)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_fields", fields)
        object.__setattr__(self, "_stage", stage)

    def __getattr__(self, attr: str) -> Any:
        if attr in self._fields:
            return getattr(self._section, attr)
        inner = {f.removeprefix(f"{attr}.") for f in self._fields if f.startswith(f"{attr}.")}
        if inner:  # a nested section of which some fields are declared
            return _SectionView(getattr(self._section, attr), f"{self._name}.{attr}", inner, self._stage)
        raise UndeclaredConfigRead(_message(self._stage, f"{self._name}.{attr}"))

    def __setattr__(self, attr: str, value: Any) -> None:
        raise AttributeError("a stage's config view is read-only")


class ConfigView:
    """The parts of a :class:`Config` one stage declares; any other read raises UndeclaredConfigRead."""

    def __init__(self, cfg: Config, stage: str):
        whole, fields = _split(STAGE_INPUTS[stage])
        object.__setattr__(self, "_cfg", cfg)
        object.__setattr__(self, "_stage", stage)
        object.__setattr__(self, "_whole", whole)
        object.__setattr__(self, "_fields", fields)

    @property
    def output_dir(self) -> Any:
        return self._cfg.output_dir

    def model_dump(self, **kwargs: Any) -> dict[str, Any]:
        """Only the declared keys (what the stage may record of its config)."""
        dumped = self._cfg.model_dump(**kwargs)
        out: dict[str, Any] = {"output_dir": dumped["output_dir"]}
        out.update({s: dumped[s] for s in self._whole})
        for section, fields in self._fields.items():
            for field in fields:
                src, dst, *path = dumped[section], out.setdefault(section, {}), *field.split(".")
                for part in path[:-1]:
                    src, dst = src[part], dst.setdefault(part, {})
                dst[path[-1]] = src[path[-1]]
        return out

    def __getattr__(self, name: str) -> Any:
        if name in self._whole:
            return getattr(self._cfg, name)
        if name in self._fields:
            return _SectionView(getattr(self._cfg, name), name, self._fields[name], self._stage)
        raise UndeclaredConfigRead(_message(self._stage, name))

    def __setattr__(self, attr: str, value: Any) -> None:
        raise AttributeError("a stage's config view is read-only")


def _message(stage: str, key: str) -> str:
    return (f"internal error: the {stage} stage read config key {key!r}, which it does not declare in "
            f"diffpipe.stages.STAGE_INPUTS, so editing it would not rerun the stage; please report this")


def view(cfg: Config, stage: str) -> ConfigView | Config:
    """What ``stage`` may read of ``cfg``. Training gets the whole config (see TRAIN_UNTRACKED)."""
    return cfg if stage == "train" else ConfigView(cfg, stage)


# -- the stages as functions ---------------------------------------------------------
# The CLI, the tests' helpers and the benchmarks call these, so each stage is wired
# once (arguments included) and reads its config only through its view.
def _as(cfg: Config | ConfigView, stage: str) -> Any:
    if isinstance(cfg, ConfigView) and cfg._stage == stage:
        return cfg
    # Resolved here too: a config parsed by diffpipe.config alone has a local model's family still to read.
    return view(resolve(cfg._cfg if isinstance(cfg, ConfigView) else cfg), stage)


def validate(cfg: Config, paths: Any, *, rehash: bool = False, workers: int | None = None, tokens: bool = True,
             console: Any = None) -> Any:
    """Check every dataset file; write the manifest and the reports (``diffpipe validate``)."""
    from diffpipe.data.dataset.discover import run_folders
    from diffpipe.data.dataset.validate import run_validation
    from diffpipe.families.token_counter import FamilyTokenCounter
    from diffpipe.hub import check_local_model

    cfg = _as(cfg, "validate")
    check_local_model(cfg.model)  # a missing or incomplete model folder fails here, before any file is read
    return run_validation(cfg.datasets, cfg.validation, manifest_path=paths.manifest,
                          report_json=paths.report_json, report_html=paths.report_html, rehash=rehash,
                          tokens=FamilyTokenCounter(cfg.model) if tokens else None, workers=workers,
                          console=console, exclude=run_folders(cfg.output_dir, cfg.cache.dir))


def plan(cfg: Config, paths: Any) -> Any:
    """Assign the manifest's items to shards and write the shard specs (``diffpipe plan``)."""
    from diffpipe.data.cache.plan import make_plan
    from diffpipe.families import get_family

    cfg = _as(cfg, "plan")
    family = get_family(cfg.model).with_trained_text(cfg.train.text_encoder.encoders)
    for ds in cfg.datasets:
        if ds.references > family.max_references:
            raise ValueError(
                f"datasets[{ds.name}]: {ds.references} reference images per item, but this model ({family.name}"
                f"{' ' + family.variant if getattr(family, 'variant', None) else ''}) takes at most "
                f"{family.max_references}; several references are for Qwen-Image-Edit `variant: 2509 | 2511` and flux2 / flux2-klein `variant: edit`"
            )
        if ds.control_from_last_frame != family.uses_last_frame:
            raise ValueError(
                f"datasets[{ds.name}].control_from_last_frame: set it to true for first-and-last-frame models "
                f"(Wan variant 2.1-flf2v) and only for them; this model ({family.name}"
                f"{' ' + family.variant if getattr(family, 'variant', None) else ''}) "
                f"{'conditions on a first and a last frame' if family.uses_last_frame else 'has no last-frame input'}"
            )
    return make_plan(paths.manifest, cfg.datasets, cfg.cache, latent_identity=family.vae_identity(),
                     text_identity=family.text_identity(), pixel_multiple=family.pixel_multiple, paths=paths,
                     global_batch=cfg.train.batch_size * cfg.train.grad_accum,
                     fps=family.fps, frame_rule=family.frame_rule, text_control=family.text_uses_control)


def cache_latents(cfg: Config, paths: Any, shard: str, *, regenerate: bool = False, trust: bool = False) -> Any:
    """Build one latent shard (``diffpipe cache latents``)."""
    from diffpipe.cache_jobs import cache_latents as build

    cfg = _as(cfg, "cache")
    return build(paths.latent_spec(shard), paths.latent_shard(shard), cfg.model, cfg.cache,
                 store=paths.cache_store(cfg.cache.dir), regenerate=regenerate, trust=trust)


def cache_text(cfg: Config, paths: Any, shard: str, *, regenerate: bool = False) -> Any:
    """Build one text shard (``diffpipe cache text``)."""
    from diffpipe.cache_jobs import cache_text as build

    cfg = _as(cfg, "cache")
    return build(paths.text_spec(shard), paths.text_shard(shard), cfg.model, cfg.cache,
                 store=paths.cache_store(cfg.cache.dir), regenerate=regenerate,
                 trained_text=cfg.train.text_encoder.encoders)


def cache_empty(cfg: Config, paths: Any, *, regenerate: bool = False) -> Any:
    """Encode the empty caption (``diffpipe cache empty``)."""
    from diffpipe.cache_jobs import cache_empty_text

    cfg = _as(cfg, "cache")
    return cache_empty_text(paths.text_empty, cfg.model, cfg.cache, spec_path=paths.empty_spec,
                            store=paths.cache_store(cfg.cache.dir), regenerate=regenerate,
                            trained_text=cfg.train.text_encoder.encoders)


def prepare_data(cfg: Config, paths: Any, *, empty_caption: bool = True) -> None:
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
