"""Helpers the Snakefile imports: config loading, per-stage digests, targets.

Kept here (not in .smk files) so they are plain, unit-tested Python.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from diffpipe import paths
from diffpipe.config import Config, ValidationConfig, parse_config
from diffpipe.data.discover import dataset_files
from diffpipe.utils import digest, write_if_changed

RESOLVED_CONFIG = "resolved-config.yaml"

# The config sections each stage reads. A stage's params carry the digest of
# exactly these, so editing e.g. sample prompts reruns only the sample rule.
STAGE_SECTIONS: dict[str, tuple[str, ...]] = {
    "validate": ("datasets", "validation", "model"),
    "plan": ("datasets", "validation", "cache", "model"),
    "cache": ("model", "cache"),
    "train": ("model", "train"),
    "export": ("model", "export"),
    "sample": ("model", "sample"),
}


def load(config: dict[str, Any]) -> Config:
    return parse_config(dict(config), "(Snakemake config)")


def stage_digest(cfg: Config, stage: str) -> str:
    dumped = cfg.model_dump(mode="json")
    return digest({k: dumped[k] for k in STAGE_SECTIONS[stage]})[:16]


def write_resolved_config(cfg: Config) -> str:
    """Write the validated config (defaults filled in) where every rule reads it.

    Rewritten only when it changes; rules do not list it as an input (their
    params carry per-stage digests instead), so unrelated edits rerun nothing.
    """
    target = Path(cfg.output_dir) / RESOLVED_CONFIG
    write_if_changed(target, yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return str(target)


def dataset_inputs(cfg: Config) -> list[str]:
    """Every media and caption file: the validate rule's inputs.

    Snakemake reruns validation when one of them changes content (checksum for
    files up to 1 MB, mtime above) or when files are added or removed.
    """
    vcfg: ValidationConfig = cfg.validation
    files: list[str] = []
    for ds in cfg.datasets:
        if not Path(ds.path).is_dir():
            raise FileNotFoundError(f"datasets[{ds.name}].path: folder not found: {ds.path}")
        files.extend(str(p) for p in dataset_files(ds, vcfg))
    return files


def out(cfg: Config, rel: str) -> str:
    """An output template under output_dir (wildcards left in place)."""
    return os.path.join(cfg.output_dir, rel)


# What the export rule declares per format (a file inside a folder format).
EXPORT_OUTPUTS = {
    "diffusers": paths.EXPORT_DIFFUSERS,
    "peft": paths.EXPORT_PEFT,
    "comfyui": paths.EXPORT_COMFYUI,
    "kohya": paths.EXPORT_KOHYA,
    "merged": paths.EXPORT_MERGED,
}


def export_formats(cfg: Config) -> list[str]:
    """The configured formats, plus ``diffusers`` (the sample rule reads it), in config order."""
    return list(dict.fromkeys(["diffusers", *cfg.export.formats]))


def export_outputs(cfg: Config) -> dict[str, str]:
    """Output name -> path of the export rule: one per format, and the model card."""
    outputs = {fmt: out(cfg, EXPORT_OUTPUTS[fmt]) for fmt in export_formats(cfg)}
    outputs["card"] = out(cfg, f"{paths.EXPORT_DIR}/{paths.EXPORT_CARD}")
    return outputs


def export_format_args(cfg: Config) -> str:
    """``--format X`` for each exported format (the rule's shell command)."""
    return " ".join(f"--format {fmt}" for fmt in export_formats(cfg))


def final_targets(cfg: Config) -> list[str]:
    return [
        out(cfg, paths.REPORT_HTML),
        *export_outputs(cfg).values(),
        out(cfg, paths.SAMPLES_DIR),
    ]
