"""Export a trained adapter in every requested format, with metadata and a model card."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from diffpipe.config import Config
from diffpipe.export.card import write_card
from diffpipe.export.comfyui import export_comfyui
from diffpipe.export.convert import module_loras
from diffpipe.export.diffusers_format import export_diffusers
from diffpipe.export.keymaps import denoiser_skeleton, keymap_for_model
from diffpipe.export.kohya import export_kohya, kohya_metadata
from diffpipe.export.merged import export_merged
from diffpipe.export.metadata import gather_info, tensors_digest
from diffpipe.export.peft_format import export_peft
from diffpipe.models.base import Family
from diffpipe.paths import EXPORT_CARD, EXPORT_NAMES, FORMATS, RunPaths
from diffpipe.training.adapter import PEFT_PREFIX, load_adapter


@dataclass
class ExportResult:
    files: dict[str, Path]
    card: Path

    def __str__(self) -> str:
        return ", ".join(f"{k}: {v}" for k, v in self.files.items()) + f", card: {self.card}"


def export_lora(
    adapter_dir: str | Path,
    out_dir: str | Path,
    family: Family,
    formats: list[str],
    *,
    config: Config | None = None,
    run: RunPaths | None = None,
) -> ExportResult:
    """Write ``adapter_dir`` (a PEFT adapter folder) in each of ``formats`` under ``out_dir``.

    File names are ``paths.EXPORT_NAMES``; every file carries the same
    ``diffpipe.*`` metadata (base model identity, rank/alpha/targets, steps,
    dataset summary, resolved config, tensor hash) and ``README.md`` describes them.
    """
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown or not formats:
        raise ValueError(f"export formats {unknown or formats}: choose from {', '.join(FORMATS)}")
    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    state_dict, lora_cfg = load_adapter(adapter_dir)
    info = gather_info(adapter_dir, lora_cfg, family, config=config, run=run)
    header = {**info.header(), "diffpipe.adapter_sha256": tensors_digest(state_dict)}
    mods = module_loras(state_dict, lora_cfg)
    skeleton = denoiser_skeleton(family) if {"comfyui", "kohya"} & set(formats) else None
    files: dict[str, Path] = {}
    for fmt in dict.fromkeys(formats):
        target = out_dir / EXPORT_NAMES[fmt]
        if fmt == "diffusers":
            prefixed = {f"{family.denoiser_name}.{k}": v for k, v in state_dict.items()}
            meta = {**header, "diffpipe.tensors_sha256": tensors_digest(prefixed)}
            files[fmt] = export_diffusers(state_dict, lora_cfg, target, family, meta)
        elif fmt == "peft":
            meta = {**header, "diffpipe.tensors_sha256": tensors_digest({PEFT_PREFIX + k: v for k, v in state_dict.items()})}
            files[fmt] = export_peft(state_dict, lora_cfg, target, meta)
        elif fmt == "comfyui":
            files[fmt] = export_comfyui(mods, keymap_for_model(family.name, skeleton), target, header)
        elif fmt == "kohya":
            title = f"{out_dir.parent.name or 'diffpipe'}-{family.name}-lora"
            started = _started_at(run)
            meta = {**header, **kohya_metadata(info, dict(skeleton.config), title=title, started_at=started)}
            files[fmt] = export_kohya(mods, keymap_for_model(family.name, skeleton), target, meta)
        elif fmt == "merged":
            files[fmt] = export_merged(adapter_dir, target, family, header)
    samples = []
    if run is not None:
        # The workflow renders samples after export: link the grid it will write.
        found = sorted(run.samples_dir.glob("sample-*.png")) if run.samples_dir.is_dir() else []
        samples = [Path(os.path.relpath(p, out_dir)) for p in found + [run.sample_grid]]
    card = write_card(out_dir / EXPORT_CARD, info, files, pipeline=family.pipeline_class.__name__, samples=samples,
                      load_args=family.lora_load_kwargs)
    return ExportResult(files, card)


def _started_at(run: RunPaths | None) -> float | None:
    # Training writes its config first: its mtime is when the run started.
    if run is not None and (run.train_dir / "config.yaml").exists():
        return (run.train_dir / "config.yaml").stat().st_mtime
    return None
