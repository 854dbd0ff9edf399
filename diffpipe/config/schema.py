"""What the models generate: the JSON schema Snakemake validates with, and the reference table in
docs/configuration.md (both drift-tested)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from diffpipe.config.root import Config


def json_schema() -> dict[str, Any]:
    """The JSON schema Snakemake validates the YAML config with."""
    schema = Config.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    _no_defaults_under_null(schema)
    return schema


def _no_defaults_under_null(schema: dict[str, Any]) -> None:
    """Drop the property defaults of sections that may be null (``train.token_routing: null``).

    Snakemake fills defaults into every object subschema of an ``anyOf``, even where the value is null, and then
    fails with an AttributeError; pydantic fills those defaults anyway when it parses the config."""
    defs = schema.get("$defs", {})

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            options = node.get("anyOf") or []
            if any(o.get("type") == "null" for o in options if isinstance(o, dict)):
                for o in options:
                    ref = o.get("$ref", "") if isinstance(o, dict) else ""
                    for prop in defs.get(ref.rsplit("/", 1)[-1], {}).get("properties", {}).values():
                        prop.pop("default", None)
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(schema)


def _rows(model: type[BaseModel], prefix: str) -> list[tuple[str, str, str]]:
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        ann = field.annotation
        sub = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        if sub is None and getattr(ann, "__origin__", None) is list:
            (arg,) = ann.__args__
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                rows.append((key, "(required)" if field.is_required() else "", field.description or ""))
                rows.extend(_rows(arg, f"{key}[].") )
                continue
        if sub is not None:
            rows.extend(_rows(sub, f"{key}."))
            continue
        default = "(required)" if field.is_required() else f"`{field.get_default(call_default_factory=True)!r}`"
        rows.append((key, default, field.description or ""))
    return rows


def reference_markdown() -> str:
    """The config reference table of docs/configuration.md, generated from the models (drift-tested)."""
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    for key, default, desc in _rows(Config, ""):
        lines.append(f"| `{key}` | {default} | {desc.replace('|', '/')} |")
    return "\n".join(lines)
