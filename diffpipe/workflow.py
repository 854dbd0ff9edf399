"""Helpers the Snakefile imports: config loading, per-stage digests, targets.

Kept here (not in .smk files) so they are plain, unit-tested Python.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

import yaml

from diffpipe import paths, stages
from diffpipe.config import Config, ConfigError, parse_config
from diffpipe.data.dataset.discover import list_dataset, run_folders, vshard_names, vshard_of
from diffpipe.stage_inputs import sample_export_format
from diffpipe.utils import digest, stable_json, write_if_changed

RESOLVED_CONFIG = "resolved-config.yaml"

def load(config: dict[str, Any]) -> Config:
    return check_snakemake_paths(parse_config(dict(config), "(Snakemake config)"))


def check_snakemake_paths(cfg: Config) -> Config:
    """Refuse an ``output_dir`` Snakemake cannot use: ``{`` or ``}`` in it would be read as wildcards.

    Every other character (spaces, quotes, ``$``, ``;``, newlines) is safe: each rule
    quotes what it puts in its shell command.
    """
    if any(c in str(cfg.output_dir) for c in "{}"):
        raise ConfigError(f"output_dir: {cfg.output_dir!r} contains '{{' or '}}', which the Snakemake workflow "
                          "reads as a wildcard in every output path; choose a folder name without braces")
    return cfg


def stage_digest(cfg: Config, stage: str) -> str:
    """The rerun trigger of ``stage``'s rule: the digest of the config keys it declares (diffpipe.stages)."""
    return stages.stage_digest(cfg, stage)


def write_resolved_config(cfg: Config) -> str:
    """Write the validated config (defaults filled in) where every rule reads it.

    Rewritten only when it changes; rules do not list it as an input (their
    params carry per-stage digests instead), so unrelated edits rerun nothing.
    """
    target = Path(cfg.output_dir) / RESOLVED_CONFIG
    write_if_changed(target, yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return str(target)


DATASET_FINGERPRINT = "validate/dataset.fingerprint"


def dataset_fingerprint(cfg: Config) -> str:
    """Write a digest of every dataset file's path, size and mtime: the validate rule's input.

    One small file instead of every media and caption file as an input keeps
    the DAG small at 100,000 items. It is rewritten only when a file was added,
    removed or changed, and then validation reruns (reading only those files).
    With ``validation.shards > 1`` each validation shard's media files (path,
    kind, size, mtime) go to its listing file: its job's input and work list.
    """
    entries = []
    shards = vshard_names(cfg.validation.shards)
    per_shard: list[list] = [[] for _ in shards]
    roots: dict[str, str] = {}
    for ds in cfg.datasets:
        if ds.path is not None and not Path(ds.path).is_dir():
            raise FileNotFoundError(f"datasets[{ds.name}].path: folder not found: {ds.path}")
        # A hub id resolves to its snapshot folder (the commit is in its name).
        listing = list_dataset(ds, cfg.validation, with_stats=True, exclude=run_folders(cfg.output_dir, cfg.cache.dir))
        if listing.error and listing.error[0] == "missing_dataset":  # a hub id not found, as a missing folder
            raise FileNotFoundError(listing.error[1])
        stats = dict(listing.stats)
        for rel in listing.metadata:  # few files; not in the listing's stats
            st = os.stat(os.path.join(listing.root, rel))
            stats[rel] = (st.st_size, st.st_mtime_ns)
        entry = [ds.name, str(listing.root), sorted(stats.items()), sorted((p.rel, p.reason) for p in listing.problems)]
        entries.append(entry + ([listing.error] if listing.error else []))  # folders keep their digest
        if shards and listing.root_ok:
            roots[ds.name] = str(listing.root)
            media = listing.media
            if listing.table is not None:  # a table dataset's shards are its table files (tshards)
                media = {os.path.relpath(f, listing.root): listing.table.fmt for f in listing.table.files}
            for rel, kind in media.items():
                per_shard[vshard_of(ds.name, rel, len(shards))].append([ds.name, rel, kind, *stats.get(rel, (0, 0))])
    target = Path(cfg.output_dir) / DATASET_FINGERPRINT
    write_if_changed(target, digest(entries) + "\n")
    for name, files in zip(shards, per_shard, strict=True):
        # A validation shard's job reads only its media files: only their change reruns it. It takes
        # them from here (diffpipe.data.dataset.vshards.read_listing) instead of listing every file again.
        listing_file = {"shard": name, "shards": len(shards), "roots": roots, "files": files}
        write_if_changed(paths.RunPaths(cfg.output_dir).validate_listing(name), stable_json(listing_file) + "\n")
    return str(target)


def validation_probes(cfg: Config) -> list[str]:
    """The validation shards' probe tables the validate rule merges (none with ``validation.shards: 1``)."""
    return [str(paths.RunPaths(cfg.output_dir).validate_probe(n)) for n in vshard_names(cfg.validation.shards)]


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


def sample_format(cfg: Config) -> str:
    """The export the sample rule reads: the diffusers file, or the PEFT folder for LoKr/LoHa
    (diffusers' ``load_lora_weights`` reads neither)."""
    return sample_export_format(cfg.train.lora)


def export_formats(cfg: Config) -> list[str]:
    """The configured formats, plus the one the sample rule reads (``sample_format``), in config order."""
    return list(dict.fromkeys([sample_format(cfg), *cfg.export.formats]))


def export_outputs(cfg: Config) -> dict[str, str]:
    """Output name -> path of the export rule: one per format, and the model card.

    A run training both Wan 2.2 A14B experts (``model.expert: both``) writes the diffusers
    and peft files once more for the low-noise expert, under its suffix: outputs too. (Read
    from the config: importing the model families would cost every job seconds.)
    """
    outputs = {fmt: out(cfg, EXPORT_OUTPUTS[fmt]) for fmt in export_formats(cfg)}
    suffixes = [paths.LOW_NOISE_SUFFIX] if cfg.model.expert == "both" else []
    for suffix in suffixes:
        for fmt in ("diffusers", "peft"):
            if fmt in outputs:  # the file itself, or the file in the peft folder
                plain, named = (f"{paths.EXPORT_DIR}/{paths.export_name(fmt, x)}" for x in ("", suffix))
                outputs[fmt + suffix] = out(cfg, EXPORT_OUTPUTS[fmt].replace(plain, named, 1))
    outputs["card"] = out(cfg, f"{paths.EXPORT_DIR}/{paths.EXPORT_CARD}")
    outputs["hub_card"] = out(cfg, f"{paths.EXPORT_DIR}/{paths.EXPORT_HUB_CARD}")  # what `diffpipe push` uploads
    return outputs


def export_format_args(cfg: Config) -> str:
    """``--format X`` for each exported format, shell-quoted (the rule puts it in as it is)."""
    return shlex.join(arg for fmt in export_formats(cfg) for arg in ("--format", fmt))


def launcher_args(wildcards: Any, resources: Any) -> str:
    """The train rule's ``resources.mpi`` launcher (e.g. ``srun --kill-on-bad-exit=1``), each word shell-quoted.

    A launcher is several words, so Snakemake's ``:q`` (one word) cannot quote it: it is
    split as a shell would split it and joined back quoted, so ``$(...)``, backticks,
    ``;`` or ``>`` in it reach the launcher as text instead of running. A params function
    reading ``resources`` is "derived" for Snakemake: changing the launcher (another
    profile) does not rerun training.
    """
    text = str(resources.mpi or "")
    try:
        return shlex.join(shlex.split(text))
    except ValueError as err:
        raise ValueError(f"resources.mpi of the train rule: cannot split {text!r} into words ({err})") from None


def final_targets(cfg: Config) -> list[str]:
    """What ``rule all`` asks for: every stage's outputs, and last the run report that shows them."""
    return [
        out(cfg, paths.REPORT_HTML),
        *export_outputs(cfg).values(),
        out(cfg, paths.SAMPLES_DIR),
        out(cfg, paths.RUN_REPORT),
    ]
