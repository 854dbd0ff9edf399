"""Reading a config is parsing it, then resolving it: a local model's family, read from its ``model_index.json``.

Parsing (:mod:`diffpipe.config`) reads no file and looks up no family. A config whose ``model.path`` is
a local folder or a Hugging Face id leaves ``model.family`` as written (null: to be detected);
:func:`diffpipe.families.resolve_family` reads the model's index, fills the family in or checks the given
one. :func:`load_config` and :func:`parse_config` are the config module's followed by that step: the
front ends read configs through them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffpipe import config
from diffpipe.config import Config


def resolve(cfg: Config, base: str | Path | None = None) -> Config:
    """``cfg`` with its model section resolved (:func:`diffpipe.families.resolve_family`)."""
    if cfg.model.flavor != "local" or cfg.model.path is None:
        return cfg  # a tiny model: nothing to read
    # Imported here for start-up time: the registry imports torch, which a tiny config's commands never need.
    from diffpipe.families import resolve_family

    model = resolve_family(cfg.model, base)
    return cfg if model is cfg.model else cfg.model_copy(update={"model": model})


def parse_config(data: dict[str, Any], source: str = "<dict>", *, base: str | Path | None = None) -> Config:
    """:func:`diffpipe.config.parse_config`, then the resolution step."""
    return resolve(config.parse_config(data, source, base=base), base)


def load_config(path: str | Path, *, base: str | Path | None = None) -> Config:
    """:func:`diffpipe.config.load_config`, then the resolution step."""
    return resolve(config.load_config(path, base=base), base)


def folder_config(folder: Path, out: Path | None = None) -> Config:
    """The config ``diffpipe validate FOLDER`` checks ``folder`` with: the default rules, its outputs in
    ``out`` (default: ``runs/validate-<folder name>``)."""
    name = folder.resolve().name or "data"
    try:
        return parse_config({"output_dir": str(out or Path("runs") / f"validate-{name}"),
                             "datasets": [{"name": name, "path": str(folder)}]}, f"validate {folder}")
    except config.ConfigError as err:
        raise config.ConfigError(f"{err}\n(with a FOLDER, the output_dir is --out: give one outside {folder})") from None
