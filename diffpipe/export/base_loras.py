"""Reading ``model.base_loras`` into the run's adapter folders that training and samples fold in.

Each file goes through ``diffpipe import-lora``'s reader (any format it reads, every tensor checked against
the model) into ``<run>/base_loras/<content digest>/``, once per content: a renamed file is not read again,
an edited one is (:mod:`diffpipe.training.base_loras` folds the folders in).
"""

from __future__ import annotations

from pathlib import Path

from diffpipe.config.model import ModelConfig
from diffpipe.export.import_lora import import_lora
from diffpipe.models.base import Family
from diffpipe.training.base_loras import adapter_dir
from diffpipe.training.text_encoders import load_text_adapters


def prepare_base_loras(model: ModelConfig, family: Family, run_root: str | Path) -> list[tuple[Path, float]]:
    """``(adapter folder, scale)`` of each base LoRA of ``model`` (paths resolved), read in if not yet."""
    out = []
    for i, base in enumerate(model.base_loras):
        folder = adapter_dir(run_root, base.path)
        if not folder.is_dir():
            try:
                import_lora(base.path, folder, family)
            except (ValueError, OSError) as err:
                if not folder.is_dir():  # else another rank of the run read the same content first
                    raise ValueError(f"model.base_loras[{i}].path: {err}") from None
        if load_text_adapters(folder):
            raise ValueError(f"model.base_loras[{i}].path {base.path}: holds a text encoder's LoRA; base LoRAs "
                             "are folded into the denoiser only (use a LoRA without the text-encoder part)")
        out.append((folder, base.scale))
    return out
