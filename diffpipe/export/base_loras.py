"""Reading ``model.base_loras`` into the run's adapter folders that caching, training and samples fold in.

Each file goes through ``diffpipe import-lora``'s reader (any format it reads, every tensor checked against
the model; a text encoder's part for the families whose text encoders take a LoRA) into
``<run>/base_loras/<content digest>/``, once per content: a renamed file is not read again, an edited one is
(:mod:`diffpipe.training.base_loras` folds the folders in).
"""

from __future__ import annotations

from pathlib import Path

from diffpipe.config.model import ModelConfig
from diffpipe.export.import_lora import import_lora
from diffpipe.models.base import Family
from diffpipe.training.base_loras import adapter_dir, has_text_part, with_base_text


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
