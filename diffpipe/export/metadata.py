"""What every exported file carries: base model identity, LoRA settings, training and data summary.

Everything lands in the safetensors header as strings (``diffpipe.*`` keys,
JSON values), and in a ``README.md`` model card beside the files.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import peft
import pyarrow.parquet as pq
import torch
from safetensors import safe_open

from diffpipe.config import Config, load_yaml
from diffpipe.models import _common as common
from diffpipe.models.base import Family
from diffpipe.paths import RunPaths
from diffpipe.stage_inputs import ExportInputs
from diffpipe.training.adapter import WEIGHTS_NAME, adapter_kind
from diffpipe.utils import stable_json


@dataclass
class ExportInfo:
    """Facts about one trained adapter, gathered once and written into every format."""

    family: str
    flavor: str
    model_path: str | None
    weights: str  # fingerprint of the base denoiser's weights
    rank: int
    alpha: float
    targets: list[str]
    training: dict[str, Any] = field(default_factory=dict)  # step, epoch (from the adapter header)
    dataset: dict[str, Any] = field(default_factory=dict)  # item counts, buckets
    config: dict[str, Any] | None = None  # the resolved experiment config
    trigger_words: list[str] = field(default_factory=list)
    kind: str = "lora"  # train.lora.kind: lora, dora, lokr, loha

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def header(self) -> dict[str, str]:
        """``diffpipe.*`` safetensors metadata (strings only, as the format requires)."""
        return {
            "diffpipe.base_model": stable_json({"family": self.family, "flavor": self.flavor,
                                                "path": self.model_path, "weights_sha256": self.weights}),
            "diffpipe.lora": stable_json({"rank": self.rank, "alpha": self.alpha, "targets": self.targets,
                                         "kind": self.kind}),
            "diffpipe.training": stable_json(self.training),
            "diffpipe.dataset": stable_json(self.dataset),
            "diffpipe.config": stable_json(self.config or {}),
        }


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def denoiser_fingerprint(family: Family) -> str:
    """The trained base weights: every trained part's (both Wan 2.2 A14B experts with ``model.expert: both``)."""
    if family.cfg.flavor == "tiny":
        return common.module_fingerprint(family.load_denoiser())
    prints = [common.weights_fingerprint(family.cfg, part.attr) for part in family.denoiser_parts]
    return prints[0] if len(prints) == 1 else hashlib.sha256("|".join(prints).encode()).hexdigest()


def _adapter_header(adapter_dir: Path) -> dict[str, Any]:
    with safe_open(str(adapter_dir / WEIGHTS_NAME), framework="pt") as f:
        meta = f.metadata() or {}
    try:
        return json.loads(meta.get("diffpipe", "{}"))
    except json.JSONDecodeError:
        return {}


def _dataset_summary(run: RunPaths | None) -> dict[str, Any]:
    if run is None:
        return {}
    summary: dict[str, Any] = {}
    if run.manifest.exists():
        table = pq.read_table(run.manifest)
        summary["items"] = table.num_rows
        if "dataset" in table.column_names:
            names = table.column("dataset").to_pylist()
            summary["items_per_dataset"] = {n: names.count(n) for n in sorted(set(names))}
    if run.plan_summary.exists():
        plan = json.loads(run.plan_summary.read_text())
        for key in ("buckets", "items", "shards"):
            if key in plan:
                summary[f"plan_{key}"] = plan[key]
    return summary


def _trained_config(config: Config | ExportInputs | None, run: RunPaths | None) -> dict[str, Any] | None:
    """The config the adapter was trained with: the run's ``train/config.yaml`` when there is one.

    Recorded in every file's metadata. Taken from the run (rewritten only when training
    reruns) rather than from today's config, so the files never describe edits made
    after training, and export need not rerun for them (diffpipe.stages).
    """
    if run is not None:
        for f in (run.train_dir / "config.yaml", run.root / "resolved-config.yaml"):
            if f.exists():
                return load_yaml(f)
    return config.model_dump(mode="json") if config is not None else None


def gather_info(adapter_dir: str | Path, lora_cfg: peft.LoraConfig, family: Family, *,
                config: Config | ExportInputs | None = None, run: RunPaths | None = None) -> ExportInfo:
    """Collect what the exports record about ``adapter_dir`` (run files are optional)."""
    adapter_dir = Path(adapter_dir)
    header = _adapter_header(adapter_dir)
    resolved = _trained_config(config, run)
    triggers = [d["caption_prefix"].strip() for d in (resolved or {}).get("datasets", []) if d.get("caption_prefix")]
    return ExportInfo(
        family=family.name,
        flavor=family.cfg.flavor,
        model_path=family.cfg.origin,
        weights=denoiser_fingerprint(family),
        rank=int(lora_cfg.r),
        alpha=float(lora_cfg.lora_alpha if adapter_kind(lora_cfg) in ("lora", "dora") else lora_cfg.alpha),
        kind=adapter_kind(lora_cfg),
        targets=[lora_cfg.target_modules] if isinstance(lora_cfg.target_modules, str) else sorted(lora_cfg.target_modules),
        training={k: header[k] for k in ("step", "epoch", "ema_decay") if k in header},
        dataset=_dataset_summary(run),
        config=resolved,
        trigger_words=triggers,
    )
