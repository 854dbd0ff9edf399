"""The root of the config (``Config``): the sections together, and the checks that span several of them."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, ValidationInfo, model_validator

from diffpipe import config_paths
from diffpipe.config.base import PathText, Section
from diffpipe.config.bench import BenchConfig
from diffpipe.config.cache import CacheConfig
from diffpipe.config.dataset import DatasetConfig
from diffpipe.config.export import ExportConfig
from diffpipe.config.model import ModelConfig
from diffpipe.config.sample import SampleConfig
from diffpipe.config.train import TrainConfig
from diffpipe.config.validation import ValidationConfig


class Config(Section):
    output_dir: PathText = Field("runs/demo", description="Folder that receives every output of the run.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Which model to fine-tune.")
    datasets: list[DatasetConfig] = Field(..., description="Training datasets.", min_length=1)
    validation: ValidationConfig = Field(default_factory=ValidationConfig, description="Dataset checks.")
    cache: CacheConfig = Field(default_factory=CacheConfig, description="Latent and text-embedding caches.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Training.")
    export: ExportConfig = Field(default_factory=ExportConfig, description="LoRA export.")
    sample: SampleConfig = Field(default_factory=SampleConfig, description="Sample images.")
    bench: BenchConfig = Field(default_factory=BenchConfig, description="`diffpipe bench`: speed and memory sweeps.")

    @model_validator(mode="after")
    def _unique_dataset_names(self) -> Config:
        names = [d.name for d in self.datasets]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"datasets: duplicate name(s) {dupes}")
        return self

    @model_validator(mode="after")
    def _same_references(self) -> Config:
        # Each bucket's control latents are one array, so every item has the same number of references.
        counts = {d.name: d.references for d in self.datasets if d.references}
        if len(set(counts.values())) > 1:
            raise ValueError(f"datasets: every dataset with control images needs the same number of references; "
                             f"they have {counts}")
        return self

    @model_validator(mode="after")
    def _base_targets(self) -> Config:
        for i, d in enumerate(self.datasets):
            if d.prior_target == "base" and d.role != "regularization":
                raise ValueError(f"datasets[{i}].prior_target base needs datasets[{i}].role: regularization")
            if d.prior_target == "base" and (self.train.mode != "lora" or self.train.pipeline_stages > 1):
                raise ValueError(f"datasets[{i}].prior_target base (the base model's prediction: the LoRA "
                                 "switched off) needs train.mode lora and train.pipeline_stages: 1")
            if d.prior_target == "base" and self.train.text_encoder.encoders:
                # Its prediction would see the trained encoders' embeddings, not the base model's.
                raise ValueError(f"datasets[{i}].prior_target base needs train.text_encoder.encoders empty (the "
                                 "base prediction is taken on the text the trained encoders give); use "
                                 "prior_target: data")
        return self

    @model_validator(mode="after")
    def _trained_text_keeps_its_dtype(self) -> Config:
        if self.model.text_encoder_weights == "fp8" and self.train.text_encoder.encoders:
            raise ValueError(f"model.text_encoder_weights fp8 stores the text encoders in float8, and "
                             f"train.text_encoder.encoders {self.train.text_encoder.encoders} trains them: use "
                             "text_encoder_weights auto to train a text encoder")
        return self

    @model_validator(mode="after")
    def _export_holds_the_lora_kind(self) -> Config:
        """A format that cannot hold ``train.lora.kind`` is a config error, before training
        (``diffpipe.export.api`` says why per format); LoKr/LoHa default to the peft export."""
        kind, formats = self.train.lora.kind, self.export.formats
        cannot = {"lokr": {"diffusers"}, "loha": {"diffusers"}, "dora": {"comfyui", "kohya"}}.get(kind, set())
        if kind in ("lokr", "loha") and "formats" not in self.export.model_fields_set:
            object.__setattr__(self.export, "formats", ["peft"])
        elif bad := sorted(cannot & set(formats)):
            raise ValueError(f"export.formats {bad}: cannot hold a train.lora.kind {kind} adapter exactly "
                             "(docs/formats.md, LoRA variants); drop them")
        return self

    @model_validator(mode="after")
    def _separate_folders(self, info: ValidationInfo) -> Config:
        """output_dir, cache.dir and the dataset folders must not overlap (see diffpipe.config_paths)."""
        base = Path((info.context or {}).get("base") or ".").absolute()
        if problems := config_paths.folder_problems(self, base):
            raise ValueError("\n  ".join(problems))
        return self
