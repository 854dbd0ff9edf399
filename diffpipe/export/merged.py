"""Merged format: the base pipeline with the LoRA fused into the denoiser, as a diffusers folder."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from peft.tuners.tuners_utils import BaseTunerLayer

from diffpipe.export.text_encoders import merge_into
from diffpipe.export.verify_checks import FileCheck, differs, probe
from diffpipe.models.base import Family, split_parts
from diffpipe.training.adapter import apply_state, load_adapter
from diffpipe.training.base_loras import BaseDeltas, with_base_text
from diffpipe.training.text_encoders import load_text_adapters
from diffpipe.utils import atomic_path

INFO_NAME = "diffpipe_lora.json"


#: What a merged denoiser's trained layer must give on its probe vectors: module -> (x, (W + delta) @ x).
Probes = dict[str, tuple[torch.Tensor, torch.Tensor]]


def export_merged(adapter_dir: str | Path, out_dir: str | Path, family: Family,
                  metadata: dict[str, str] | None = None, checks: list[FileCheck] | None = None, *,
                  bases: list[tuple[Path, float]] | None = None) -> Path:
    """Load the family pipeline, merge the adapter at its trained scale, ``save_pretrained`` atomically.

    ``bases`` (``export.include_base_loras``: ``(folder, scale)`` of the base LoRAs read in): folded into the
    denoiser and the text encoders first, as training folded them, so the folder is the trained model whole.

    Each trained part (both Wan 2.2 A14B experts with ``model.expert: both``) gets its
    own LoRA fused in, and each text encoder trained beside it (``train.text_encoder``) its own. The folder loads with ``<Pipeline>.from_pretrained`` and needs
    no LoRA support; ``diffpipe_lora.json`` records which LoRA was fused in.

    The saved folder is read back (:func:`read_back`, appended to ``checks``): each trained layer's
    saved weight, one tensor at a time, against base + PEFT's delta on probe vectors taken before the merge.
    """
    # A copy: the caller's family goes on to verify the files against the encoders as published.
    pipe = with_base_text(copy.copy(family), bases or []).load_pipeline()  # text encoders: the bases folded in
    probes: dict[str, Probes] = {}
    state_dict, lora_cfg = load_adapter(adapter_dir)
    for attr, part_state in split_parts(state_dict, family.denoiser_parts).items():
        if bases:  # one part (export refuses several): the denoiser training loaded
            BaseDeltas.read(bases).fold_all(getattr(pipe, attr))
        denoiser = family.trained_base(getattr(pipe, attr))
        setattr(pipe, attr, denoiser)
        apply_state(denoiser, part_state, lora_cfg, source=f"{adapter_dir} ({attr})")
        probes[attr] = _probes(denoiser)
        for module in denoiser.modules():  # PEFT's own merge: LoRA, DoRA, LoKr and LoHa alike
            if isinstance(module, BaseTunerLayer):
                module.merge()
        denoiser.unload_lora()  # drop the adapter layers, keep the merged weights
    for name, (sd, cfg) in load_text_adapters(adapter_dir).items():  # train.text_encoder
        merge_into(getattr(pipe, name), sd, cfg)
    out_dir = Path(out_dir)
    with atomic_path(out_dir, is_dir=True) as tmp:
        pipe.save_pretrained(tmp, safe_serialization=True)
        (tmp / INFO_NAME).write_text(json.dumps(metadata or {}, indent=2, sort_keys=True))
    if checks is not None:
        checks.append(read_back(out_dir, probes))
    return out_dir


@torch.no_grad()
def _probes(denoiser: torch.nn.Module) -> Probes:
    """Each adapted layer's probe vectors and ``(W + delta) @ x`` from its base weight and PEFT's delta (one
    layer's delta at a time, as PEFT's merge forms it). DoRA layers are left out: their merge rescales rows."""
    out: Probes = {}
    for name, module in denoiser.named_modules():
        if not isinstance(module, BaseTunerLayer) or not module.active_adapters:
            continue
        (adapter,) = module.active_adapters
        if getattr(module, "use_dora", {}).get(adapter):
            continue
        weight = module.get_base_layer().weight
        x = probe(weight.flatten(1).shape[1])
        out[name] = (x, weight.flatten(1).double() @ x + module.get_delta_weight(adapter).flatten(1).double() @ x)
    return out


def read_back(folder: Path, probes: dict[str, Probes]) -> FileCheck:
    """The saved merged folder, each part's trained layers read one tensor at a time (``safe_open``) and
    compared with base + trained delta on their probes; ``probes``: by pipeline component."""
    from safetensors import safe_open  # deferred: only the export job reads it back

    check = FileCheck(folder, "merged", "safetensors, tensor by tensor")
    off, seen = [], set()
    for attr, layers in probes.items():
        for file in sorted((folder / attr).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as tensors:
                for key in tensors.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    module = key.removesuffix(".weight")
                    if key.endswith(".weight") and module in layers:
                        x, want = layers[module]
                        seen.add(f"{attr}/{module}")
                        if differs(tensors.get_tensor(key).flatten(1).double() @ x, want):
                            off.append(f"{attr}/{module}")
    check.placed = len(seen)
    check.keys("layer(s) differ from base + trained delta", off)
    check.keys("trained layer(s) missing from the folder", {f"{a}/{m}" for a, ls in probes.items() for m in ls} - seen)
    return check
