"""Folder checks of a config: the run never writes into a dataset, nor reads its own outputs as data.

A run owns ``output_dir`` and writes the content-addressed store at
``cache.dir``; Snakemake empties some of their folders before a rerun
(``plan/``, ``samples/``). A dataset folder (and its separate mask and
control folders) is the user's. So none of these may be the same folder as
another or lie inside it, either way round: ``output_dir: data/samples``
once replaced a user's ``samples/`` with a run's outputs, and a run folder
inside a dataset would be read back as training data.

Paths are compared resolved, symbolic links followed, with relative paths
taken from ``base``: the folder Snakemake runs in (``diffpipe run
--workdir``, else the working folder), where every stage reads them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from diffpipe import paths as layout
from diffpipe.model_ids import is_model_id, split_file_id

if TYPE_CHECKING:
    from diffpipe.config import Config

# Folders of a run that Snakemake or a stage replaces: a store, model or LoRA inside one would be deleted.
_REPLACED = (
    Path(layout.MANIFEST).parent,
    Path(layout.PLAN_DIR),
    Path(layout.LATENT_SHARD).parent,
    Path(layout.TEXT_SHARD).parent,
    Path(layout.TRAIN_DIR),
    Path(layout.EXPORT_DIR),
    Path(layout.SAMPLES_DIR),
    Path(layout.LOGS),
    Path(layout.BENCHMARKS),
    Path(layout.PROGRESS_DIR),  # the jobs' status files, rewritten as they run
)


def resolve(path: str, base: Path) -> Path:
    """``path`` as an absolute path with every symbolic link followed (``path`` relative to ``base``)."""
    joined = base / path
    try:
        return joined.resolve()
    except (OSError, RuntimeError):  # a link loop: compare it as written
        return Path(os.path.abspath(joined))


_SAME, _INSIDE, _CONTAINS = "is the same folder as", "is inside", "contains"


def _relation(a: Path, b: Path) -> str | None:
    """How ``a`` lies relative to ``b`` (both resolved), or None when apart."""
    if a == b:
        return _SAME
    if b in a.parents:
        return _INSIDE
    if a in b.parents:
        return _CONTAINS
    return None


def dataset_folders(cfg: Config) -> list[tuple[str, str]]:
    """(key, path) of every folder a dataset reads: ``datasets[i].path``, ``.mask_path``, ``.control_path``."""
    found = []
    for i, ds in enumerate(cfg.datasets):
        if ds.path:
            found.append((f"datasets[{i}].path", ds.path))
        for role in ds.aux_roles():
            folder, _, key = ds.aux_source(role)
            if folder:
                found.append((f"datasets[{i}].{key}", folder))
    return found


def model_inputs(cfg: Config) -> list[tuple[str, str]]:
    """(key, path) of the other files and folders a run reads: the model, a LoRA to start from, sample images."""
    # A Hugging Face id is read from the hub cache, not from a folder of the run.
    found = [("model.path", cfg.model.path)] if cfg.model.path and not is_model_id(cfg.model.path) else []
    found += [(f"model.single_files.{k}", v) for k, v in cfg.model.single_files.items() if not split_file_id(v)]
    found += [(f"model.base_loras[{i}].path", b.path) for i, b in enumerate(cfg.model.base_loras)
              if not split_file_id(b.path)]
    found += [("train.lora.init_from", cfg.train.lora.init_from)] if cfg.train.lora.init_from else []
    for i, v in enumerate(cfg.sample.images or []):
        found += [(f"sample.images[{i}][{k}]", p) for k, p in enumerate(v)] if isinstance(v, list) else [
            (f"sample.images[{i}]", v)]
    found += [(f"sample.last_images[{i}]", v) for i, v in enumerate(cfg.sample.last_images or [])]
    found += [(f"sample.videos[{i}]", v) for i, v in enumerate(cfg.sample.videos or [])]
    return found


def folder_problems(cfg: Config, base: Path) -> list[str]:
    """What is wrong with the folders of ``cfg`` (empty: nothing); each line names both keys and paths."""
    problems = []
    run = resolve(cfg.output_dir, base)
    writers = [("output_dir", run)] + ([("cache.dir", resolve(cfg.cache.dir, base))] if cfg.cache.dir else [])
    # A dataset folder and a folder the run writes: apart, either way round.
    for key, value in dataset_folders(cfg):
        folder = resolve(value, base)
        for wkey, written in writers:
            if how := _relation(written, folder):
                problems.append(
                    f"{wkey} {written} {how} {key} {folder}: the run would write into the dataset, or read "
                    f"its own outputs as training data; choose another {wkey}, apart from every dataset folder"
                )
    # The store, a model or a LoRA inside a run folder that a rerun replaces would be deleted.
    readers = writers[1:] + [(key, resolve(value, base)) for key, value in model_inputs(cfg)]
    for key, path in readers:
        for rel in _REPLACED:
            if (how := _relation(path, run / rel)) in (_SAME, _INSIDE):
                problems.append(
                    f"{key} {path} {how} {run / rel}, a folder of the run (output_dir) that a rerun replaces: "
                    f"move it out of {rel}/"
                )
    # The run must not write into the user's model folder either.
    for key, value in model_inputs(cfg):
        path = resolve(value, base)
        for wkey, written in writers:
            if (how := _relation(written, path)) in (_SAME, _INSIDE):
                problems.append(
                    f"{wkey} {written} {how} {key} {path}: the run would write into it; choose another {wkey}"
                )
    return problems + _inside_dataset_problems(cfg, base)


def _inside_dataset_problems(cfg: Config, base: Path) -> list[str]:
    """``eval_files`` and ``metadata`` name files of the dataset: refuse ones outside its folder."""
    problems = []
    for i, ds in enumerate(cfg.datasets):
        if ds.path is None:  # a hub dataset: its files are the snapshot's
            continue
        root, real_root = Path(os.path.abspath(base / ds.path)), resolve(ds.path, base)
        named = [(f"datasets[{i}].eval_files[{j}]", f) for j, f in enumerate(ds.eval_files)]
        named += [(f"datasets[{i}].metadata", ds.metadata)] if ds.metadata else []
        for key, value in named:
            # As written (`sub/../a.png`) or through the dataset's links: either way inside.
            if root not in Path(os.path.abspath(root / value)).parents and real_root not in resolve(value, root).parents:
                problems.append(
                    f"{key} {value!r} is outside the dataset folder {root}: give a path inside it, relative "
                    f"to datasets[{i}].path"
                )
    return problems
