"""The part of the config each workflow stage reads, as one typed, read-only object per stage.

A stage's Snakemake rule reruns when the digest of what it reads changes
(:func:`diffpipe.stages.stage_digest`), so a stage that read a key it does not declare would
keep a stale result after that key was edited. Each stage therefore receives one of these
classes instead of the whole :class:`~diffpipe.config.Config`: its fields are exactly the keys
the stage reads (a whole section, or the few fields of one it needs, in a small class of its
own), so reading any other key is an ``AttributeError`` (and a type checker's error), and
:func:`declared_keys` turns the fields into the rule's rerun triggers. ``output_dir`` is on
every one: every output path depends on it already.

Training reads the whole config (see ``diffpipe.stages.TRAIN_UNTRACKED``) and has no class here.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Self

from pydantic import BaseModel

from diffpipe.config import (
    CacheConfig,
    Config,
    DatasetConfig,
    ExportConfig,
    LoraConfig,
    ModelConfig,
    SampleConfig,
    ValidationConfig,
)


class _Part:
    """Shared by every class here: the keys' values as the config would dump them."""

    def model_dump(self, **kwargs: Any) -> dict[str, Any]:
        """Only these fields, dumped as :meth:`Config.model_dump` dumps them (what a stage may record)."""
        return {f.name: _dump(getattr(self, f.name), kwargs) for f in dataclasses.fields(self)}  # type: ignore[arg-type]


def _dump(value: Any, kwargs: dict[str, Any]) -> Any:
    if isinstance(value, BaseModel | _Part):
        return value.model_dump(**kwargs)
    if isinstance(value, list):
        return [_dump(v, kwargs) for v in value]
    return value


# -- parts of a section ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CacheFolder(_Part):
    """``cache.dir`` alone: dataset discovery keeps the cache folder out."""

    dir: str | None


@dataclasses.dataclass(frozen=True)
class TrainedText(_Part):
    """``train.text_encoder.encoders``: a trained text encoder's captions are cached as token ids."""

    encoders: list[str]


@dataclasses.dataclass(frozen=True)
class PlanTrain(_Part):
    """What planning reads of ``train``: buckets smaller than one global batch are filled by repetition."""

    batch_size: int
    grad_accum: int
    text_encoder: TrainedText


@dataclasses.dataclass(frozen=True)
class CacheTrain(_Part):
    """What caching reads of ``train``: which text encoders train."""

    text_encoder: TrainedText


@dataclasses.dataclass(frozen=True)
class TrainedLora(_Part):
    """``train.lora``: export rebuilds an adapter from a checkpoint with it; samples load the export its kind allows."""

    lora: LoraConfig


# -- one class per stage -----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ValidateInputs(_Part):
    """What ``diffpipe validate`` reads."""

    output_dir: str
    datasets: list[DatasetConfig]
    validation: ValidationConfig
    model: ModelConfig
    cache: CacheFolder

    @classmethod
    def of(cls, cfg: Config) -> Self:
        return cls(cfg.output_dir, cfg.datasets, cfg.validation, cfg.model, CacheFolder(cfg.cache.dir))


@dataclasses.dataclass(frozen=True)
class PlanInputs(_Part):
    """What ``diffpipe plan`` reads."""

    output_dir: str
    datasets: list[DatasetConfig]
    validation: ValidationConfig
    cache: CacheConfig
    model: ModelConfig
    train: PlanTrain

    @classmethod
    def of(cls, cfg: Config) -> Self:
        t = cfg.train
        train = PlanTrain(t.batch_size, t.grad_accum, TrainedText(t.text_encoder.encoders))
        return cls(cfg.output_dir, cfg.datasets, cfg.validation, cfg.cache, cfg.model, train)


@dataclasses.dataclass(frozen=True)
class CacheInputs(_Part):
    """What ``diffpipe cache latents | text | empty`` read."""

    output_dir: str
    model: ModelConfig
    cache: CacheConfig
    train: CacheTrain

    @classmethod
    def of(cls, cfg: Config) -> Self:
        return cls(cfg.output_dir, cfg.model, cfg.cache, CacheTrain(TrainedText(cfg.train.text_encoder.encoders)))


@dataclasses.dataclass(frozen=True)
class ExportInputs(_Part):
    """What ``diffpipe export`` reads (and records in the files' metadata when the run has no config of its own)."""

    output_dir: str
    model: ModelConfig
    export: ExportConfig
    train: TrainedLora

    @classmethod
    def of(cls, cfg: Config) -> Self:
        return cls(cfg.output_dir, cfg.model, cfg.export, TrainedLora(cfg.train.lora))


@dataclasses.dataclass(frozen=True)
class SampleInputs(_Part):
    """What ``diffpipe sample`` reads."""

    output_dir: str
    model: ModelConfig
    sample: SampleConfig
    train: TrainedLora

    @classmethod
    def of(cls, cfg: Config) -> Self:
        return cls(cfg.output_dir, cfg.model, cfg.sample, TrainedLora(cfg.train.lora))


def sample_export_format(lora: LoraConfig) -> str:
    """The export the sample stage reads: the diffusers file, or the PEFT folder for LoKr/LoHa
    (diffusers' ``load_lora_weights`` reads neither)."""
    return "diffusers" if lora.kind in ("lora", "dora") else "peft"


def declared_keys(cls: type[_Part], prefix: str = "") -> tuple[str, ...]:
    """The config keys ``cls`` holds, as ``section`` or ``section.field`` (``output_dir`` left out)."""
    hints = typing.get_type_hints(cls)
    keys: list[str] = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        kind = hints[f.name]
        if isinstance(kind, type) and issubclass(kind, _Part):
            keys += declared_keys(kind, f"{prefix}{f.name}.")
        elif not (f.name == "output_dir" and not prefix):
            keys.append(prefix + f.name)
    return tuple(keys)
