"""LoRA adapters through PEFT: add to a denoiser, save and load in PEFT's format.

A trained adapter is a folder in PEFT's own layout (``adapter_model.safetensors``
with ``base_model.model.`` keys, plus ``adapter_config.json``), so it is already
a valid PEFT artifact; exporters read it from there.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import peft
import torch
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file

from diffpipe.config import LoraConfig
from diffpipe.training.finite import check_tensors
from diffpipe.utils import atomic_path, stable_json

PEFT_PREFIX = "base_model.model."
_CONFIGS = {"LORA": peft.LoraConfig, "LOKR": peft.LoKrConfig, "LOHA": peft.LoHaConfig}
WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"


def peft_config(lcfg: LoraConfig, targets: list[str]) -> peft.PeftConfig:
    """PEFT config from ours (``kind``: LoraConfig, with DoRA; LoKrConfig; LoHaConfig).

    Alpha is independent of rank (scale = alpha / rank) for every kind.
    """
    target_modules = target_pattern(targets, lcfg.blocks) if lcfg.blocks else targets
    if lcfg.kind == "lokr":
        return peft.LoKrConfig(r=lcfg.rank, alpha=lcfg.alpha, rank_dropout=lcfg.dropout, target_modules=target_modules,
                               decompose_both=lcfg.lokr_decompose_both, decompose_factor=lcfg.lokr_factor)
    if lcfg.kind == "loha":
        return peft.LoHaConfig(r=lcfg.rank, alpha=lcfg.alpha, rank_dropout=lcfg.dropout, target_modules=target_modules)
    extra = {"use_dora": True} if lcfg.kind == "dora" else {}  # the default config stays as it always was
    return peft.LoraConfig(
        r=lcfg.rank,
        lora_alpha=lcfg.alpha,
        lora_dropout=lcfg.dropout,
        target_modules=target_modules,
        init_lora_weights="gaussian" if lcfg.init == "gaussian" else True,
        **extra,
    )


def adapter_kind(config: peft.PeftConfig) -> str:
    """``lora``, ``dora``, ``lokr`` or ``loha``: the ``train.lora.kind`` of a PEFT config."""
    if isinstance(config, peft.LoKrConfig):
        return "lokr"
    if isinstance(config, peft.LoHaConfig):
        return "loha"
    if isinstance(config, peft.LoraConfig):
        return "dora" if config.use_dora else "lora"
    raise ValueError(f"unsupported PEFT adapter type {config.peft_type} (diffpipe trains LoRA, DoRA, LoKr, LoHa)")


def target_pattern(targets: list[str], blocks: list[str]) -> str:
    """One regex (PEFT full-matches it against module paths): a target name inside a matching block."""
    names = "|".join(re.escape(t) for t in targets)
    inside = "|".join(f"(?:{b})" for b in blocks)
    return rf"^(?=.*(?:{inside})).*(?:^|\.)(?:{names})$"


def load_lora_file(path: str | Path, denoiser_name: str) -> dict[str, torch.Tensor]:
    """LoRA tensors keyed like ``lora_state_dict`` from a PEFT folder or a diffusers LoRA file."""
    path = Path(path)
    if path.is_dir():
        return load_adapter(path)[0]
    if not path.is_file():
        raise FileNotFoundError(f"train.lora.init_from: no LoRA at {path}")
    out = {}
    for key, value in load_file(str(path)).items():
        key = key.removeprefix(PEFT_PREFIX).removeprefix(f"{denoiser_name}.")
        out[key.replace(".lora.down.", ".lora_A.").replace(".lora.up.", ".lora_B.")] = value
    return out


def init_from(denoiser: torch.nn.Module, path: str | Path, denoiser_name: str) -> None:
    """Load an existing LoRA into the freshly added adapter; every adapter tensor must be covered."""
    sd = load_lora_file(path, denoiser_name)
    check_tensors(sd, path, what="train.lora.init_from")
    own = get_peft_model_state_dict(denoiser)
    missing = sorted(set(own) - set(sd))
    unknown = sorted(set(sd) - set(own))
    if missing or unknown:
        raise ValueError(f"train.lora.init_from {path}: {len(missing)} adapter tensors missing (e.g. "
                         f"{missing[:2]}), {len(unknown)} unknown (e.g. {unknown[:2]}); same targets and blocks?")
    bad = [k for k in own if own[k].shape != sd[k].shape]
    if bad:
        raise ValueError(f"train.lora.init_from {path}: shape {tuple(sd[bad[0]].shape)} for {bad[0]}, the "
                         f"adapter has {tuple(own[bad[0]].shape)}; set train.lora.rank to the file's rank")
    set_peft_model_state_dict(denoiser, {k: v.float() for k, v in sd.items()})


def add_lora(denoiser: torch.nn.Module, config: peft.LoraConfig) -> list[torch.nn.Parameter]:
    """Freeze the denoiser, inject the LoRA layers, return the trainable parameters."""
    denoiser.requires_grad_(False)
    denoiser.add_adapter(config)
    params = [p for p in denoiser.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"train.lora.targets {sorted(config.target_modules)} matched no module of the denoiser")
    # Train the adapter in float32 even when frozen weights are lower precision.
    for p in params:
        p.data = p.data.float()
    return params


def lora_state_dict(denoiser: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors (keys relative to the denoiser), float32 copies."""
    sd = get_peft_model_state_dict(denoiser)
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in sd.items()}


def config_dict(config: peft.LoraConfig) -> dict[str, Any]:
    """JSON-safe ``LoraConfig.to_dict()`` (sets become sorted lists)."""
    out = {}
    for k, v in config.to_dict().items():
        out[k] = sorted(v) if isinstance(v, set) else v
    return out


def save_adapter(
    directory: str | Path,
    state_dict: dict[str, torch.Tensor],
    config: peft.LoraConfig,
    metadata: dict[str, Any] | None = None,
    text_encoders: dict[str, tuple[dict[str, torch.Tensor], peft.LoraConfig]] | None = None,
) -> Path:
    """Write a PEFT adapter folder atomically; ``metadata`` goes into the safetensors header.

    ``text_encoders`` (``train.text_encoder``): each trained encoder's LoRA, written as a PEFT
    folder of the same layout in a subfolder named after the encoder (``text_encoder/``)."""
    directory = Path(directory)
    header = {"format": "pt", "diffpipe": stable_json(metadata or {})}
    with atomic_path(directory, is_dir=True) as tmp:
        _write_peft(tmp, state_dict, config, header)
        for name, (sd, cfg) in (text_encoders or {}).items():
            (tmp / name).mkdir()
            _write_peft(tmp / name, sd, cfg, header)
    return directory


def _write_peft(folder: Path, state_dict: dict[str, torch.Tensor], config: peft.PeftConfig,
                header: dict[str, str]) -> None:
    save_file({PEFT_PREFIX + k: v for k, v in state_dict.items()}, str(folder / WEIGHTS_NAME), metadata=header)
    (folder / CONFIG_NAME).write_text(json.dumps(config_dict(config), indent=2, sort_keys=True))


def load_adapter(directory: str | Path) -> tuple[dict[str, torch.Tensor], peft.LoraConfig]:
    """Read an adapter folder written by ``save_adapter`` (or by PEFT)."""
    directory = Path(directory)
    weights, cfg_file = directory / WEIGHTS_NAME, directory / CONFIG_NAME
    for f in (weights, cfg_file):
        if not f.exists():
            raise FileNotFoundError(f"adapter file missing: {f}")
    raw = load_file(str(weights))
    sd = {k.removeprefix(PEFT_PREFIX): v for k, v in raw.items()}
    try:
        fields = json.loads(cfg_file.read_text())
    except (ValueError, RecursionError) as err:  # RecursionError: JSON nested too deeply
        raise ValueError(f"{cfg_file}: not valid JSON ({type(err).__name__}: {err})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{cfg_file}: must be a JSON object (PEFT config field -> value)")
    kind = str(fields.pop("peft_type", "LORA")).upper()
    if kind not in _CONFIGS:
        raise ValueError(f"{cfg_file}: peft_type {kind} is not one diffpipe reads ({', '.join(_CONFIGS)})")
    try:
        return sd, _CONFIGS[kind](**fields)
    except (TypeError, ValueError) as err:  # an unknown field, or a value PEFT refuses
        raise ValueError(f"{cfg_file}: not a PEFT {kind} config: {err}") from None


def apply_adapter(denoiser: torch.nn.Module, directory: str | Path) -> torch.nn.Module:
    """Load a saved adapter into a fresh denoiser (for eval, export checks, resume)."""
    sd, cfg = load_adapter(directory)
    return apply_state(denoiser, sd, cfg, source=str(directory))


def apply_state(denoiser: torch.nn.Module, state_dict: dict[str, torch.Tensor], config: peft.LoraConfig, *,
                source: str) -> torch.nn.Module:
    """Add a LoRA with ``config`` to ``denoiser`` and load ``state_dict`` into it (``source`` names it in errors)."""
    denoiser.add_adapter(config)
    result = set_peft_model_state_dict(denoiser, state_dict)
    unexpected = getattr(result, "unexpected_keys", None) or []
    if unexpected:
        raise ValueError(f"adapter {source}: {len(unexpected)} keys match no module, e.g. {unexpected[:3]}")
    return denoiser
