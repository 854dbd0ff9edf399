"""The typed experiment config: one pydantic model per stage plus the root.

Every field carries a description: it feeds ``--help``, the JSON schema that
Snakemake validates with (``diffpipe schema``) and the README reference.
Unknown keys are errors that name the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A config problem a user can fix; the message names the key and value."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    family: str = Field("sd", description="Model family: one of the registered families (`sd`, `flux`).")
    flavor: str = Field(
        "tiny",
        description="`tiny`: small random-weight model built offline from `seed`; `local`: load the "
        "diffusers folder at `path`.",
    )
    path: str | None = Field(None, description="Local diffusers model folder (needed when flavor is `local`).")
    seed: int = Field(0, description="Seed of the tiny flavor's random weights.")
    prediction_type: Literal["epsilon", "v_prediction"] | None = Field(
        None, description="UNet families: training target; null uses the scheduler's own setting."
    )

    @model_validator(mode="after")
    def _check_flavor(self) -> ModelConfig:
        if self.flavor not in ("tiny", "local"):
            raise ValueError(f"model.flavor must be 'tiny' or 'local', got {self.flavor!r}")
        if self.flavor == "local" and not self.path:
            raise ValueError("model.path is required when model.flavor is 'local'")
        return self


class DatasetConfig(_Section):
    name: str = Field(..., description="Dataset name (used in item ids and reports).", min_length=1)
    path: str = Field(..., description="Folder of media with same-stem caption files.")
    caption_ext: str = Field(".txt", description="Caption file extension.")
    resolution: int = Field(64, description="Training resolution in pixels (bucket area = resolution²).", gt=0)
    repeats: int = Field(1, description="How many times each item appears per epoch.", ge=1)
    caption_prefix: str = Field("", description="Text put before every caption (e.g. a trigger word).")


class ValidationConfig(_Section):
    image_exts: list[str] = Field(
        [".png", ".jpg", ".jpeg", ".webp", ".bmp"], description="File extensions treated as images."
    )
    min_size: int = Field(16, description="Smallest accepted image side in pixels.", ge=1)


class CacheConfig(_Section):
    shards: int = Field(2, description="Number of cache shards (one Snakemake job each).", ge=1)
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Storage dtype of cached tensors.")
    batch_size: int = Field(8, description="Encoder batch size in cache jobs.", ge=1)


class LoraConfig(_Section):
    rank: int = Field(8, description="LoRA rank.", ge=1)
    alpha: float = Field(8.0, description="LoRA alpha; the update is scaled by alpha / rank.", gt=0)
    dropout: float = Field(0.0, description="LoRA dropout.", ge=0, lt=1)
    targets: list[str] | None = Field(
        None, description="Module names to adapt (PEFT target_modules); null = the family's defaults."
    )


class TrainConfig(_Section):
    epochs: int = Field(10, description="Passes over the training data.", ge=1)
    max_steps: int | None = Field(None, description="Stop after this many optimizer steps (overrides epochs).")
    batch_size: int = Field(4, description="Micro-batch size per process.", ge=1)
    grad_accum: int = Field(1, description="Gradient accumulation steps.", ge=1)
    lr: float = Field(1e-3, description="Peak learning rate.", gt=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="LR schedule after warmup.")
    warmup_steps: int = Field(0, description="Linear warmup steps.", ge=0)
    weight_decay: float = Field(0.0, description="AdamW weight decay.", ge=0)
    grad_clip: float = Field(1.0, description="Gradient norm clip (0 disables).", ge=0)
    precision: Literal["fp32", "bf16"] = Field("fp32", description="Training precision.")
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="DeepSpeed ZeRO stage.")
    seed: int = Field(42, description="Seed for noise, timesteps and data order.")
    save_every_epochs: int = Field(1, description="Save a LoRA every N epochs (0: only at the end).", ge=0)
    checkpoint_every_steps: int = Field(0, description="Full checkpoint every N steps (0: only at the end).", ge=0)
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA settings.")


class ExportConfig(_Section):
    formats: list[Literal["diffusers"]] = Field(["diffusers"], description="Export formats to write.")


class SampleConfig(_Section):
    prompts: list[str] = Field(["a red circle"], description="Prompts rendered with the trained LoRA.")
    steps: int = Field(10, description="Inference steps.", ge=1)
    guidance_scale: float = Field(5.0, description="Classifier-free guidance scale.", ge=0)
    seed: int = Field(0, description="Seed of the sampling noise.")
    width: int = Field(64, description="Sample width in pixels.", gt=0)
    height: int = Field(64, description="Sample height in pixels.", gt=0)


class Config(_Section):
    output_dir: str = Field("runs/demo", description="Folder that receives every output of the run.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Which model to fine-tune.")
    datasets: list[DatasetConfig] = Field(..., description="Training datasets.", min_length=1)
    validation: ValidationConfig = Field(default_factory=ValidationConfig, description="Dataset checks.")
    cache: CacheConfig = Field(default_factory=CacheConfig, description="Latent and text-embedding caches.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Training.")
    export: ExportConfig = Field(default_factory=ExportConfig, description="LoRA export.")
    sample: SampleConfig = Field(default_factory=SampleConfig, description="Sample images.")

    @model_validator(mode="after")
    def _unique_dataset_names(self) -> Config:
        names = [d.name for d in self.datasets]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"datasets: duplicate name(s) {dupes}")
        return self


def _format_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(root)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif "input" in e and not isinstance(e["input"], dict | list):
            msg += f" (got {e['input']!r})"
        lines.append(f"  {key}: {msg}")
    return "\n".join(lines)


def parse_config(data: dict[str, Any], source: str = "<dict>") -> Config:
    """Validate a config mapping; raises ConfigError naming every bad key."""
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err, source)) from None


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML config file."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    return parse_config(data, str(path))


def json_schema() -> dict[str, Any]:
    """The JSON schema Snakemake validates the YAML config with."""
    schema = Config.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema


def _rows(model: type[BaseModel], prefix: str) -> list[tuple[str, str, str]]:
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        ann = field.annotation
        sub = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        if sub is None and getattr(ann, "__origin__", None) is list:
            (arg,) = ann.__args__
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                rows.append((key, "(required)" if field.is_required() else "", field.description or ""))
                rows.extend(_rows(arg, f"{key}[].") )
                continue
        if sub is not None:
            rows.extend(_rows(sub, f"{key}."))
            continue
        default = "(required)" if field.is_required() else f"`{field.get_default(call_default_factory=True)!r}`"
        rows.append((key, default, field.description or ""))
    return rows


def reference_markdown() -> str:
    """The README's config reference table, generated from the models (drift-tested)."""
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    for key, default, desc in _rows(Config, ""):
        lines.append(f"| `{key}` | {default} | {desc.replace('|', '/')} |")
    return "\n".join(lines)
