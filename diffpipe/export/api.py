"""Export a trained adapter in every requested format, with metadata and a model card."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import peft
import torch

from diffpipe.config import Config, ConfigError
from diffpipe.export.base_loras import prepare_base_loras, with_base_loras
from diffpipe.export.card import CardFile, read_memory_plan, write_card
from diffpipe.export.comfyui import export_comfyui
from diffpipe.export.convert import fold_scale, module_loras
from diffpipe.export.diffusers_format import export_diffusers
from diffpipe.export.keymaps import denoiser_skeleton, keymap_for_model
from diffpipe.export.kohya import export_kohya, kohya_metadata
from diffpipe.export.lycoris import module_products
from diffpipe.export.merged import export_merged
from diffpipe.export.metadata import ExportInfo, gather_info, tensors_digest
from diffpipe.export.peft_format import export_peft
from diffpipe.export.text_encoders import TextLoras, kohya_tensors
from diffpipe.export.verify import VERIFY_NAME, ExportVerifyError, verify_exports
from diffpipe.families.sampling import sample_defaults
from diffpipe.models.base import Family, split_parts
from diffpipe.paths import EXPORT_CARD, EXPORT_HUB_CARD, EXPORT_NAMES, FORMATS, RunPaths, export_name
from diffpipe.stage_inputs import ExportInputs
from diffpipe.training.adapter import PEFT_PREFIX, WEIGHTS_NAME, adapter_kind, load_adapter
from diffpipe.training.base_loras import BASES_INCLUDED
from diffpipe.training.finite import check_tensors
from diffpipe.training.text_encoders import load_text_adapters
from diffpipe.utils import claim_files


@dataclass
class ExportResult:
    files: dict[str, Path]
    card: Path
    #: The verify step's report (``verify.json``): each file as its reader loads it.
    verify: Path | None = None

    def __str__(self) -> str:
        return ", ".join(f"{k}: {v}" for k, v in self.files.items()) + f", card: {self.card}"


def export_lora(
    adapter_dir: str | Path,
    out_dir: str | Path,
    family: Family,
    formats: list[str],
    *,
    config: Config | ExportInputs | None = None,
    run: RunPaths | None = None,
) -> ExportResult:
    """Write ``adapter_dir`` (a PEFT adapter folder) in each of ``formats`` under ``out_dir``.

    File names are ``paths.EXPORT_NAMES``; every file carries the same
    ``diffpipe.*`` metadata (base model identity, rank/alpha/targets, steps,
    dataset summary, resolved config, tensor hash) and ``README.md`` describes them.

    A run that trains several parts (``family.denoiser_parts``: Wan 2.2 A14B with
    ``model.expert: both``) gets a diffusers file and a PEFT folder per part, the later
    parts' names carrying their suffix (``pytorch_lora_weights_low_noise.safetensors``,
    ``peft_low_noise``; result keys ``diffusers_low_noise``, ...), and one merged
    folder with every part fused in.

    ``out_dir`` may hold other files: they stay untouched. A file or folder of the
    user's under one of the names written here is refused before anything is written.

    Then every file is read back the way its consumer reads it (``export.verify``); the findings go
    to ``verify.json``, and a file that would not load as trained raises :class:`ExportVerifyError`
    naming the file and the keys (the files stay, for a look).
    """
    parts = family.denoiser_parts
    _check_formats(formats, len(parts))
    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    adapter = _load_checked(adapter_dir)
    _check_formats_read(adapter.kind, formats)
    # out_dir may be a user's folder (--out): refuse before writing if a name we write is theirs.
    claim_files(out_dir, [EXPORT_CARD, EXPORT_HUB_CARD, VERIFY_NAME] + [export_name(fmt, part.suffix) if fmt in ("diffusers", "peft")
                                          else EXPORT_NAMES[fmt] for fmt in formats for part in parts])
    info = gather_info(adapter_dir, adapter.lora_cfg, family, config=config, run=run)
    header = {**info.header(), "diffpipe.adapter_sha256": tensors_digest(adapter.state_dict)}
    with tempfile.TemporaryDirectory(prefix="diffpipe-export-") as tmp:
        bases = _included_bases(config, family, run, Path(tmp))
        if bases:
            header[BASES_INCLUDED] = json.dumps([{"path": b.path, "scale": b.scale} for b in family.cfg.base_loras])
            adapter = _with_bases(adapter, bases, Path(tmp) / "with-base-loras", formats, header)
        merged_checks: list = []  # the merged folder's read-back (export_merged does it: it holds the base weights)
        files, card_files = _write_formats(formats, adapter, split_parts(adapter.state_dict, parts), out_dir, family,
                                           info, header, run, merged_checks)
        card_args = {"pipeline": family.pipeline_class.__name__, "memory_plan": read_memory_plan(run),
                     "bases_included": bool(bases), "sampling": (sample_defaults(family), family.guidance_arg)}
        card = write_card(out_dir / EXPORT_CARD, info, card_files, samples=_sample_links(run, out_dir), **card_args)
        write_card(out_dir / EXPORT_HUB_CARD, info, card_files, hub=True, **card_args)  # what `diffpipe push` uploads
        report = verify_exports(files, family, adapter.folder)  # the files against what they were written from
    report.checks += merged_checks
    verify = report.write(out_dir / VERIFY_NAME)
    if not report.ok:
        raise ExportVerifyError(f"{report.message()} (report: {verify})")
    return ExportResult(files, card, verify)


def _included_bases(config: Config | ExportInputs | None, family: Family, run: RunPaths | None,
                    tmp: Path) -> list[tuple[Path, float]]:
    """``model.base_loras`` read in (``(folder, scale)``) when ``export.include_base_loras`` asks, else none."""
    if config is None or not config.export.include_base_loras or not family.cfg.base_loras:
        return []
    if len(family.denoiser_parts) > 1:
        raise ConfigError("export.include_base_loras: a run with several trained parts (model.expert: both) is "
                          "not joined with its base LoRAs; export without it and load them beside the LoRAs")
    return prepare_base_loras(family.cfg, family, run.root if run else tmp)


def _with_bases(adapter: _Adapter, bases: list[tuple[Path, float]], folder: Path, formats: list[str],
                header: dict[str, str]) -> _Adapter:
    """What the LoRA files are written from: the trained adapter with the base LoRAs joined in; the merged
    folder folds the base LoRAs into its weights instead (any adapter kind), so only the files ask for it."""
    files = [f for f in formats if f != "merged"]
    joined = _load_checked(with_base_loras(adapter.folder, bases, folder, files, header)) if files else adapter
    return dataclasses.replace(joined, trained=adapter.folder, bases=tuple(bases))


def _check_formats(formats: list[str], n_parts: int) -> None:
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown or not formats:
        raise ValueError(f"export formats {unknown or formats}: choose from {', '.join(FORMATS)}")
    single_file = sorted({"comfyui", "kohya"} & set(formats))
    if n_parts > 1 and single_file:
        raise ValueError(f"export formats {single_file}: a run with model.expert both trains one LoRA per expert "
                         "and these formats hold one model's LoRA; export diffusers, peft or merged")


@dataclass(frozen=True)
class _Adapter:
    """An adapter folder as read: its tensors and config, its kind, and the text encoders' LoRAs beside it."""

    folder: Path
    state_dict: dict[str, torch.Tensor]
    lora_cfg: peft.LoraConfig
    text: TextLoras  # the text encoders trained beside it (train.text_encoder)
    kind: str
    #: ``export.include_base_loras``: the trained adapter's folder (``folder`` then holds it joined with the
    #: base LoRAs) and the base LoRAs as read in, ``(folder, scale)``, for the merged folder to fold in.
    trained: Path | None = None
    bases: tuple[tuple[Path, float], ...] = ()


def _load_checked(adapter_dir: Path) -> _Adapter:
    """Read ``adapter_dir``; a diverged run's weights are refused before anything is written, naming the tensors."""
    state_dict, lora_cfg = load_adapter(adapter_dir)
    text = load_text_adapters(adapter_dir)
    check_tensors(state_dict, adapter_dir / WEIGHTS_NAME, what="export")
    for name, (sd, _) in text.items():
        check_tensors(sd, adapter_dir / name / WEIGHTS_NAME, what="export")
    return _Adapter(adapter_dir, state_dict, lora_cfg, text, adapter_kind(lora_cfg))


def _write_formats(formats: list[str], adapter: _Adapter, by_part: dict[str, dict[str, torch.Tensor]], out_dir: Path,
                   family: Family, info: ExportInfo, header: dict[str, str],
                   run: RunPaths | None, checks: list) -> tuple[dict[str, Path], list[CardFile]]:
    """Write each format once; returns the files by name and what the model card lists."""
    parts, kind, lora_cfg, text = family.denoiser_parts, adapter.kind, adapter.lora_cfg, adapter.text
    mods = (module_loras(adapter.state_dict, lora_cfg) if kind == "lora" else
            module_products(adapter.state_dict, lora_cfg) if kind in ("lokr", "loha") else {})
    skeleton = denoiser_skeleton(family) if {"comfyui", "kohya"} & set(formats) else None
    files: dict[str, Path] = {}
    card_files: list[CardFile] = []
    for fmt in dict.fromkeys(formats):
        target = out_dir / EXPORT_NAMES[fmt]
        if fmt in ("diffusers", "peft"):
            for part in parts:
                sd, name = by_part[part.attr], fmt + part.suffix
                # Several parts: say which one each file holds (its keys no longer do).
                part_header = {**header, "diffpipe.component": part.attr} if len(parts) > 1 else header
                files[name] = _export_part(fmt, sd, lora_cfg, out_dir / export_name(fmt, part.suffix), family,
                                           part_header, text)
                card_files.append(CardFile(fmt, files[name], part.load_kwargs if fmt == "diffusers" else {},
                                           part.label if len(parts) > 1 else ""))
            continue
        extra = kohya_tensors(text, family.trainable_text_encoders, fmt) if fmt in ("comfyui", "kohya") else {}
        if fmt == "comfyui":
            files[fmt] = export_comfyui(mods, keymap_for_model(family.name, skeleton), target, header, extra)
        elif fmt == "kohya":
            title = f"{out_dir.parent.name or 'diffpipe'}-{family.name}-{kind}"
            meta = {**header, **kohya_metadata(info, dict(skeleton.config), title=title, started_at=_started_at(run))}
            files[fmt] = export_kohya(mods, keymap_for_model(family.name, skeleton), target, meta, extra)
        elif fmt == "merged":
            files[fmt] = export_merged(adapter.trained or adapter.folder, target, family, header, checks,
                                       bases=list(adapter.bases))
        card_files.append(CardFile(fmt, files[fmt]))
    return files, card_files


def _sample_links(run: RunPaths | None, out_dir: Path) -> list[Path]:
    """The workflow renders samples after export: the model card links the images and the grid it will write."""
    if run is None:
        return []
    found = sorted(run.samples_dir.glob("sample-*.png")) if run.samples_dir.is_dir() else []
    return [Path(os.path.relpath(p, out_dir)) for p in found + [run.sample_grid]]


_DORA_SCALE = ("PEFT's DoRA divides W + dW by its row norms; ComfyUI divides by the base weight's row norms "
               "(or W + dW's column norms) and A1111/Forge by W + dW's column norms, so no dora_scale "
               "reproduces the trained weights")
#: Formats whose readers cannot hold a kind, and why (checked before anything is written).
_UNREADABLE = {
    ("lokr", "diffusers"): "diffusers' load_lora_weights reads LoRA and DoRA only",
    ("loha", "diffusers"): "diffusers' load_lora_weights reads LoRA and DoRA only",
    ("dora", "comfyui"): _DORA_SCALE,
    ("dora", "kohya"): _DORA_SCALE,
}


def _check_formats_read(kind: str, formats: list[str]) -> None:
    for fmt in formats:
        if (kind, fmt) in _UNREADABLE:
            ok = [f for f in FORMATS if (kind, f) not in _UNREADABLE]
            raise ValueError(f"export format {fmt}: a {kind} adapter cannot be written there ({_UNREADABLE[kind, fmt]}); "
                             f"formats for {kind}: {', '.join(ok)}")


def _export_part(fmt: str, state_dict, lora_cfg, target: Path, family: Family, header: dict[str, str],
                 text: TextLoras) -> Path:
    """One trained part's LoRA as a diffusers file (``transformer.`` keys) or a PEFT folder, with the
    text encoders' LoRAs (``text``) in the same file or folder."""
    if fmt == "diffusers":
        # Scale folded in: ComfyUI and other header-blind readers then apply the trained strength too.
        state_dict, lora_cfg = fold_scale(state_dict, lora_cfg)
        text = {name: fold_scale(sd, cfg) for name, (sd, cfg) in text.items()}
        prefixed = {f"{name}.{k}": v for name, (sd, _) in {family.denoiser_name: (state_dict, lora_cfg), **text}.items()
                    for k, v in sd.items()}
        meta = {**header, "diffpipe.tensors_sha256": tensors_digest(prefixed)}
        return export_diffusers(state_dict, lora_cfg, target, family, meta, text)
    meta = {**header, "diffpipe.tensors_sha256": tensors_digest({PEFT_PREFIX + k: v for k, v in state_dict.items()})}
    return export_peft(state_dict, lora_cfg, target, meta, text)


def _started_at(run: RunPaths | None) -> float | None:
    # Training writes its config first: its mtime is when the run started.
    if run is not None and (run.train_dir / "config.yaml").exists():
        return (run.train_dir / "config.yaml").stat().st_mtime
    return None
