"""The typed experiment config: one pydantic model per stage plus the root.

Every field carries a description: it feeds ``--help``, the JSON schema that
Snakemake validates with (``diffpipe schema``) and the config reference in ``docs/configuration.md``.
Unknown keys are errors that name the key.

One module per section (``model``, ``dataset``, ``validation``, ``cache``, ``train`` with its parts
``adapter``, ``objective`` and ``monitor``, ``export``, ``sample``, ``bench``), the root in ``root``,
the shared value types in ``base``; ``load`` reads a config, ``schema`` generates the schema and the
reference table. The names below are the public API: import them from ``diffpipe.config``.
"""

from __future__ import annotations

from diffpipe.config.adapter import EmaConfig, LoraConfig, LoraKind, TextEncoderTrainConfig
from diffpipe.config.base import (
    MAX_BATCH,
    MAX_EPOCHS,
    MAX_FRAMES,
    MAX_REPEATS,
    MAX_SHARDS,
    MAX_SIDE,
    MAX_STEPS,
    MAX_WORKERS,
    AspectRatio,
    Bool,
    ConfigError,
    Float,
    HubId,
    Int,
    LoadDtype,
    PathText,
    Quantile,
    Seed,
    Text,
)
from diffpipe.config.bench import BENCH_AXES, BenchConfig, GridValue
from diffpipe.config.cache import CacheConfig
from diffpipe.config.dataset import CONTROL_ROLES, MAX_REFERENCES, DatasetConfig
from diffpipe.config.export import ExportConfig, ExportFormat
from diffpipe.config.load import load_config, load_yaml, parse_config
from diffpipe.config.model import ModelConfig
from diffpipe.config.monitor import EvalConfig, ProfileConfig
from diffpipe.config.objective import ObjectiveConfig
from diffpipe.config.root import Config
from diffpipe.config.sample import SampleConfig
from diffpipe.config.schema import _rows, json_schema, reference_markdown
from diffpipe.config.train import BF16_OPTIMIZERS, QUANTISED_OPTIMIZERS, TokenRoutingConfig, TrainConfig
from diffpipe.config.validation import ValidationConfig

__all__ = [
    "BENCH_AXES",
    "BF16_OPTIMIZERS",
    "CONTROL_ROLES",
    "MAX_BATCH",
    "MAX_EPOCHS",
    "MAX_FRAMES",
    "MAX_REFERENCES",
    "MAX_REPEATS",
    "MAX_SHARDS",
    "MAX_SIDE",
    "MAX_STEPS",
    "MAX_WORKERS",
    "AspectRatio",
    "BenchConfig",
    "Bool",
    "CacheConfig",
    "Config",
    "ConfigError",
    "DatasetConfig",
    "EmaConfig",
    "EvalConfig",
    "ExportConfig",
    "ExportFormat",
    "Float",
    "GridValue",
    "HubId",
    "Int",
    "LoadDtype",
    "LoraConfig",
    "LoraKind",
    "ModelConfig",
    "ObjectiveConfig",
    "PathText",
    "ProfileConfig",
    "QUANTISED_OPTIMIZERS",
    "Quantile",
    "SampleConfig",
    "Seed",
    "Text",
    "TextEncoderTrainConfig",
    "TokenRoutingConfig",
    "TrainConfig",
    "ValidationConfig",
    "_rows",  # tests/unit/test_docs.py walks the reference rows
    "json_schema",
    "load_config",
    "load_yaml",
    "parse_config",
    "reference_markdown",
]
