"""Reading ``model.base_loras`` into the run's adapter folders that caching, training and samples fold in.

Each file goes through ``diffpipe import-lora``'s reader (any format it reads, every tensor checked against
the model; a text encoder's part for the families whose text encoders take a LoRA) into
``<run>/base_loras/<content digest>/``, once per content: a renamed file is not read again, an edited one is
(:mod:`diffpipe.training.base_loras` folds the folders in).
"""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe.config.base import ConfigError
from diffpipe.config.model import ModelConfig
from diffpipe.export.convert import Lora, adapter_from_loras, module_loras
from diffpipe.export.import_lora import import_lora
from diffpipe.models.base import Family
from diffpipe.training.adapter import adapter_kind, load_adapter, save_adapter
from diffpipe.training.base_loras import adapter_dir, has_text_part, with_base_text
from diffpipe.training.text_encoders import load_text_adapters

#: Why a LoRA file cannot carry the base LoRAs beside an adapter of this kind (``export.include_base_loras``).
_NOT_CONCATENATED = {
    "dora": "DoRA divides W + dW by the row norms of the whole trained weight, so a base LoRA cannot stand "
            "beside it as more low-rank columns",
    "lokr": "a LoKr's update is a Kronecker product, not a low-rank product that ranks can be joined to, and a "
            "diffusers or PEFT file holds one adapter kind",
    "loha": "a LoHa's update is a Hadamard product of low-rank products, not one that ranks can be joined to, "
            "and a diffusers or PEFT file holds one adapter kind",
}


def prepare_base_loras(model: ModelConfig, family: Family, run_root: str | Path, *,
                       text_only: bool = False) -> list[tuple[Path, float]]:
    """``(adapter folder, scale)`` of each base LoRA of ``model`` (paths resolved), read in if not yet;
    ``text_only``: only those holding a text encoder's LoRA (what the text caches read)."""
    out = []
    for i, base in enumerate(model.base_loras):
        if text_only and not has_text_part(base.path):
            continue
        folder = adapter_dir(run_root, base.path)
        if not folder.is_dir():
            try:
                import_lora(base.path, folder, family)
            except (ValueError, OSError) as err:
                if not folder.is_dir():  # else another rank of the run read the same content first
                    raise ValueError(f"model.base_loras[{i}].path: {err}") from None
        out.append((folder, base.scale))
    return out


def text_base_loras(family: Family, run_root: str | Path) -> Family:
    """``family`` folding its base LoRAs' text-encoder parts into the text encoders it loads (the plan's text
    keys and the text cache jobs); the files without one are not read."""
    if not family.cfg.base_loras:
        return family
    return with_base_text(family, prepare_base_loras(family.cfg, family, run_root, text_only=True))


def _folded(lora: Lora, scale: float) -> Lora:
    """``lora`` at ``scale`` with its whole scale in ``up`` (alpha = rank): the same update, ready to join."""
    return Lora(lora.down.float(), lora.up.float() * (scale * lora.scale), float(lora.rank))


def _join(into: dict[str, Lora], add: dict[str, Lora], scale: float, source: object) -> None:
    """Add ``add`` at ``scale`` to ``into``: a module in both gets the ranks of both (``down`` rows stacked,
    ``up`` columns side by side: ``up1 @ down1 + up2 @ down2``), a module in one keeps its own."""
    for module, lora in add.items():
        lora, have = _folded(lora, scale), into.get(module)
        if have is None:
            into[module] = lora
            continue
        shape, want = (lora.up.shape[0], *lora.down.shape[1:]), (have.up.shape[0], *have.down.shape[1:])
        if shape != want:
            raise ValueError(f"export.include_base_loras: {source}: {module} updates a weight of shape "
                             f"{tuple(shape)}, the trained LoRA one of {tuple(want)}")
        into[module] = Lora(torch.cat([have.down, lora.down]), torch.cat([have.up, lora.up], dim=1),
                            float(have.rank + lora.rank))


def _plain(folder: Path, what: str, formats: list[str]) -> tuple[dict[str, Lora], dict[str, dict[str, Lora]]]:
    """A plain LoRA adapter folder's modules and its text encoders' (by encoder), or the refusal that names
    the formats and why they cannot be exact."""
    sd, cfg = load_adapter(folder)
    kind = adapter_kind(cfg)
    if kind == "lora" and any(k.endswith("lora_magnitude_vector") for k in sd):
        kind = "dora"
    if kind != "lora":
        raise ConfigError(f"export.include_base_loras: formats {', '.join(formats)}: {what} is a {kind}: "
                          f"{_NOT_CONCATENATED.get(kind, 'only plain LoRAs are joined')}; export without "
                          "include_base_loras (the card says how to load the base LoRAs beside it), or the `merged` "
                          "format alone, which folds them into the weights")
    return module_loras(sd, cfg), {name: module_loras(s, c) for name, (s, c) in load_text_adapters(folder).items()}


def with_base_loras(adapter: Path, bases: list[tuple[Path, float]], out_dir: Path, formats: list[str],
                    metadata: dict[str, str] | None = None) -> Path:
    """The trained ``adapter`` with every base LoRA (``(folder, scale)``, as :func:`prepare_base_loras` reads
    them) joined in, as one plain-LoRA adapter folder at ``out_dir``: one file then reproduces base + trained
    exactly, in every format our LoRA files are written in. ``formats``: the ones asked, named by a refusal."""
    mods, text = _plain(adapter, f"the trained LoRA {adapter}", formats)
    mods = {m: _folded(lora, 1.0) for m, lora in mods.items()}
    text = {name: {m: _folded(lora, 1.0) for m, lora in part.items()} for name, part in text.items()}
    for folder, scale in bases:
        base, base_text = _plain(folder, f"the base LoRA {folder}", formats)
        _join(mods, base, scale, folder)
        for name, part in base_text.items():
            _join(text.setdefault(name, {}), part, scale, folder / name)
    sd, cfg = adapter_from_loras(mods)
    return save_adapter(out_dir, sd, cfg, metadata, text_encoders={n: adapter_from_loras(m) for n, m in text.items()})
