"""Reading a config: YAML text or file to a validated :class:`Config`, every error naming its key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from diffpipe import yamlload
from diffpipe.config.base import ConfigError
from diffpipe.config.root import Config


def _key(loc: tuple[int | str, ...]) -> str:
    """``("datasets", 0, "weight")`` -> ``datasets[0].weight``."""
    key = ""
    for part in loc:
        key += f"[{part}]" if isinstance(part, int) else f".{part}" if key else str(part)
    return key


_HINTS = {
    "float_type": "write a number; YAML reads 1e-4 and 1.0e5 as text: write 1.0e-4 and 1.0e+5",
    "int_type": "write a whole number, without quotes, a dot or an exponent (1000000, not 1e6)",
    "bool_type": "write true or false",
}


def _format_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        key = _key(e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "string_pattern_mismatch":
            msg = "must be a path: not empty, not only spaces, no NUL character"
        if "input" in e and not isinstance(e["input"], dict):
            shown = repr(e["input"])
            msg += f" (got {shown if len(shown) <= 80 else shown[:77] + '...'})"
        if isinstance(e.get("input"), str) and e["type"] in _HINTS:
            msg += f"; {_HINTS[e['type']]}"
        lines.append(f"  {key}: {msg}" if key else f"  {msg}")
    return "\n".join(lines)


def parse_config(data: dict[str, Any], source: str = "<dict>", *, base: str | Path | None = None) -> Config:
    """Validate a config mapping; raises ConfigError naming every bad key.

    ``base``: the folder relative paths start from (``diffpipe run --workdir``); default the working folder.
    """
    try:
        return Config.model_validate(data, context={"base": base})
    except ValidationError as err:
        raise ConfigError(_format_error(err, source)) from None


def load_yaml(source: str | Path) -> Any:
    """Read user YAML safely: a ``Path`` is a file to read, a ``str`` is YAML text.

    No Python objects are built (a safe loader); a key given twice in a mapping, an
    alias bomb or a recursive alias is a ConfigError naming the key or line and the file.
    """
    name = f"config file {source}" if isinstance(source, Path) else "YAML text"
    if isinstance(source, Path):
        try:
            source = source.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"{name} not found") from None
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"{name} cannot be read: {err}") from None
    try:
        return yamlload.load(source)
    except yamlload.RefusedError as err:
        raise ConfigError(f"{name}: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{name} is not valid YAML: {err}") from None


def load_config(path: str | Path, *, base: str | Path | None = None) -> Config:
    """Read and validate a YAML config file (relative paths in it start at ``base``, default the working folder)."""
    path = Path(path)
    data = load_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    return parse_config(data, str(path), base=base)
