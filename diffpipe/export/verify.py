"""The export's verify step: read every exported file the way its consumer does, and fail the export on
anything that would not load as trained.

Each file is read by its consumer's rules, against the denoiser and text encoders built without
weights (the tiny flavor's in a blink; a local model's from its config on the meta device):

- the diffusers file through diffusers' own ``lora_state_dict`` and the models' LoRA loaders
  (``load_lora_adapter``, ``load_lora_into_text_encoder``); where ComfyUI reads the family's diffusers
  file, its CLIP text-encoder names must also be ones ComfyUI maps;
- the comfyui and kohya files through ComfyUI's key-mapping rules (``comfy_rules``): each layer name
  must land on a model weight (ComfyUI drops the rest with only a log line), at the trained strength
  (``alpha / rank``, 1.0 without ``.alpha``: the header is never read);
- the PEFT folder (and each text encoder's folder in it) through PEFT's ``set_peft_model_state_dict``.

A tensor no reader places, a trained module missing from a file, or a strength other than the trained
delta's is a problem. Strength is compared on random probe vectors (``delta @ x`` from the factors,
never the full weight update), so the check costs milliseconds per layer at any model size. LoKr and
LoHa layers of the comfyui and kohya files are compared the same way: the delta ComfyUI's LyCORIS
arithmetic applies (``kron(w1, w2)`` or ``(w1_a @ w1_b) * (w2_a @ w2_b)``, its alpha rule) against
PEFT's (``alpha / r`` times the same product of the trained tensors). The merged folder is read back
by ``export.merged.read_back`` (it needs the base weights export_merged holds); its check joins the report.
The findings go to ``verify.json`` beside the files (per file: ok, placed, problems).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from diffpipe.export.convert import Lora, module_loras
from diffpipe.export.keymaps import denoiser_skeleton, keymap_for_model
from diffpipe.export.lycoris import Product, module_products
from diffpipe.export.verify_checks import FileCheck, check_original
from diffpipe.export.verify_loaders import check_diffusers, check_peft, text_model
from diffpipe.families import spec
from diffpipe.models.base import Family, split_parts
from diffpipe.models.family.records import DenoiserPart
from diffpipe.paths import FORMATS
from diffpipe.training.adapter import adapter_kind, load_adapter
from diffpipe.training.text_encoders import load_text_adapters
from diffpipe.utils import write_text_atomic

#: The report beside the exported files (the run report reads it).
VERIFY_NAME = "verify.json"
#: Families whose kohya file ComfyUI does not map in full (Z-Image: only its diffusers names reach the
#: fused ``qkv``): that file is for kohya tools, so its names are checked against the family's key map.
KOHYA_NOT_FOR_COMFY = frozenset({"zimage"})


@dataclass
class VerifyReport:
    checks: list[FileCheck]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def as_json(self) -> dict:
        return {"ok": self.ok, "files": {c.file.name: {"format": c.fmt, "reader": c.reader, "ok": c.ok,
                                                        "placed": c.placed, "problems": c.problems}
                                         for c in self.checks}}

    def write(self, path: Path) -> Path:
        write_text_atomic(path, json.dumps(self.as_json(), indent=2) + "\n")
        return path

    def message(self) -> str:
        """What failed, file by file, with the keys."""
        return "export verify failed: " + "; ".join(
            f"{c.file} ({c.reader}): {p}" for c in self.checks for p in c.problems)


class ExportVerifyError(ValueError):
    """An exported file would not load as trained (the CLI exits 1 with this message)."""


def verify_exports(files: dict[str, Path], family: Family, adapter_dir: str | Path) -> VerifyReport:
    """Check each exported file (``files``: ``ExportResult.files``, keys ``<format><part suffix>``) against
    the adapter it was written from (``adapter_dir``)."""
    state, lora_cfg = load_adapter(adapter_dir)
    plain = adapter_kind(lora_cfg) in ("lora", "dora")  # LoKr / LoHa: strength in the comfyui / kohya files
    text = {n: module_loras(sd, cfg) for n, (sd, cfg) in load_text_adapters(adapter_dir).items()}
    by_part = split_parts(state, family.denoiser_parts)
    checks = []
    for key, path in files.items():
        fmt, part = _format_of(key, family.denoiser_parts)
        factors, magnitudes = _dora_split(by_part[part.attr])
        trained = module_loras(factors, lora_cfg) if plain else None
        products = None if plain else module_products(factors, lora_cfg)
        if fmt == "diffusers":
            checks.append(check_diffusers(path, family, _skeleton(family, part), trained, text, magnitudes))
        elif fmt == "peft":
            check = check_peft(path, family.trained_base(_skeleton(family, part)), trained, magnitudes)
            for name in text:
                check_peft(path / name, text_model(family, name), text[name], check=check, label=f"{name}/")
            checks.append(check)
        elif fmt in ("comfyui", "kohya"):
            checks.append(_check_original_file(path, fmt, family, trained if plain else products, text))
    return VerifyReport(checks)


def _skeleton(family: Family, part: DenoiserPart) -> torch.nn.Module:
    """A fresh denoiser for ``part`` (Wan 2.2's experts share one architecture: either stands for both)."""
    model = denoiser_skeleton(family)
    return getattr(model, part.attr) if len(family.denoiser_parts) > 1 and hasattr(model, part.attr) else model


def _dora_split(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A DoRA adapter's low-rank factors, and its magnitudes by module (checked as they are)."""
    suffix = ".lora_magnitude_vector"
    return ({k: v for k, v in state.items() if not k.endswith(suffix)},
            {k.removesuffix(suffix): v for k, v in state.items() if k.endswith(suffix)})


def _format_of(key: str, parts: tuple[DenoiserPart, ...]) -> tuple[str, DenoiserPart]:
    for part in parts:
        for fmt in FORMATS:
            if key == fmt + part.suffix:
                return fmt, part
    raise ValueError(f"export verify: {key!r} is no export format (one of {', '.join(FORMATS)})")


def _check_original_file(path: Path, fmt: str, family: Family, trained: dict[str, Lora] | dict[str, Product],
                         text: dict[str, dict[str, Lora]]) -> FileCheck:
    keymap = keymap_for_model(family.name, denoiser_skeleton(family))
    comfy = spec(family.name).comfy_reads_diffusers != "no-model" and not (
        fmt == "kohya" and family.name in KOHYA_NOT_FOR_COMFY)
    layers = {n: text_model(family, n).config.num_hidden_layers for n in text}
    return check_original(path, fmt, family.name, keymap, trained, text, layers, comfy_model=comfy)
