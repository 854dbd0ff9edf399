"""Find the adapter, the run and the config behind ``diffpipe export RUN_OR_CHECKPOINT``.

Accepted: a run folder (the config's ``output_dir``), an adapter folder
(``train/adapter``, ``train/loras/epoch-NNNN``, any PEFT folder), or a
DeepSpeed checkpoint (``train/checkpoints/step-NNNNNN``), whose LoRA tensors
are written out as an adapter folder first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from diffpipe.config import Config, ModelConfig
from diffpipe.families import get_family
from diffpipe.paths import RunPaths
from diffpipe.resolve import load_config
from diffpipe.stage_inputs import ExportInputs
from diffpipe.training.adapter import WEIGHTS_NAME, peft_config, save_adapter
from diffpipe.training.checkpoint import adapter_from_checkpoint, load_torch_file
from diffpipe.training.engine import deepspeed_safe_types

RESOLVED = "resolved-config.yaml"


@dataclass
class Located:
    adapter_dir: Path
    run: RunPaths | None
    config: Config | ExportInputs | None
    out_dir: Path


def _run_root(path: Path) -> Path | None:
    for folder in [path, *path.parents]:
        if (folder / RESOLVED).exists() or (folder / "train" / "config.yaml").exists():
            return folder
    return None


def _run_config(run: RunPaths) -> Config | None:
    for f in (run.root / RESOLVED, run.train_dir / "config.yaml"):
        if f.exists():
            return load_config(f)
    return None


def model_config_from_adapter(adapter_dir: Path) -> ModelConfig:
    """The base model recorded in an adapter's header (tiny flavors only: a local path needs --config)."""
    weights = adapter_dir / WEIGHTS_NAME
    try:
        with safe_open(str(weights), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("diffpipe", "{}"))
    except Exception as err:  # SafetensorError (truncated), a damaged JSON header
        raise ValueError(f"{weights} is damaged ({type(err).__name__}: {err}); export another adapter or "
                         "checkpoint, or train again") from None
    if meta.get("flavor") == "tiny" and meta.get("family"):
        return ModelConfig(family=meta["family"], flavor="tiny")
    raise ValueError(f"{adapter_dir}: cannot tell the base model; pass --config CONFIG.yaml")


def _deepspeed_states(path: Path) -> Path | None:
    files = sorted(path.glob("mp_rank_*_model_states.pt"))
    return files[0] if files else None


def adapter_from_deepspeed(checkpoint: Path, cfg: Config | ExportInputs, out_dir: Path) -> Path:
    """Write the LoRA tensors of a DeepSpeed checkpoint (frozen weights excluded) as an adapter folder."""
    states = _deepspeed_states(checkpoint)
    # weights_only: a crafted file is refused before any of it runs.
    saved = load_torch_file(states, checkpoint, allowed=deepspeed_safe_types())
    module = saved.get("module") if isinstance(saved, dict) else None
    if not isinstance(module, dict):
        raise ValueError(f"{states}: not a DeepSpeed model-states file (no 'module' weights)")
    sd = {k.replace(".default.", "."): v.float() for k, v in module.items() if ".lora_" in k}
    if not sd:
        raise ValueError(f"{states}: holds no LoRA tensors")
    step = saved.get("step")
    family = get_family(cfg.model)
    lcfg = peft_config(cfg.train.lora, family.lora_targets(cfg.train.lora.targets))
    meta = {"family": cfg.model.family, "flavor": cfg.model.flavor, "checkpoint": str(checkpoint), "step": step}
    return save_adapter(out_dir, sd, lcfg, meta)


def locate(path: Path | None, config: Config | ExportInputs | None) -> Located:
    """Resolve what to export; errors name the path and what was expected there."""
    if path is None:
        if config is None:
            raise ValueError("give a run folder, an adapter folder or --config")
        run = RunPaths(config.output_dir)
        return Located(run.adapter_dir, run, config, run.export_dir)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"not found: {path}")
    root = _run_root(path)
    run = RunPaths(root) if root is not None else None
    config = config or (_run_config(run) if run else None)
    if (path / WEIGHTS_NAME).exists():
        adapter = path
    elif (path / "train" / "adapter" / WEIGHTS_NAME).exists():
        adapter = RunPaths(path).adapter_dir
    elif (path / "diffpipe.json").exists() or (path / "checkpoints").is_dir():
        # A training checkpoint (or a run's checkpoints folder: the latest one):
        # its header records family and flavor, so no --config is needed.
        base = run.export_dir if run else path.parent
        adapter = adapter_from_checkpoint(path, base / f".adapter-{path.name}")
    elif _deepspeed_states(path) is not None:
        if config is None:
            raise ValueError(f"{path}: a DeepSpeed checkpoint needs its run's config; pass --config")
        base = run.export_dir if run else path.parent
        adapter = adapter_from_deepspeed(path, config, base / f".adapter-{path.name}")
    else:
        raise FileNotFoundError(
            f"{path}: neither a run folder (with train/adapter), an adapter folder (with {WEIGHTS_NAME}) "
            "nor a DeepSpeed checkpoint (with mp_rank_00_model_states.pt)"
        )
    if run is not None and adapter.resolve() == run.adapter_dir.resolve():
        out = run.export_dir
    elif run is not None:
        out = run.export_dir / path.name
    else:
        out = path.parent / f"{path.name}-export"
    return Located(adapter, run, config, out)
