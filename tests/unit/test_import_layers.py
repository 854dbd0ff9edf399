"""Imports point one way (STYLE.md point 14): every ``diffpipe`` import, at module level or deferred
into a function, goes from a module to one in its own layer or a lower one.

The table below is the whole rule. A new top-level module gets a row here, or this test fails and
says so. Imports under ``if TYPE_CHECKING:`` count too: a type-only import still ties the two
layers together for a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import diffpipe

# Bottom to top. A module may import modules of its own layer and of every layer before it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("paths", "utils", "yamlload", "logs", "runlock", "runproc", "ownership", "model_ids",
              "progress")),
    ("config", ("config", "config_paths", "policy", "stage_inputs")),  # pure parsing: no file I/O, no family lookup
    ("hub", ("hub",)),  # model folders and Hugging Face ids: file I/O, no family lookup
    ("data", ("data",)),
    ("models", ("models",)),  # shared family machinery and pure math
    ("families", ("families", "resolve")),  # the registry and one folder per family; reading a config with it
    ("training", ("training",)),
    ("export", ("export",)),  # reads training's LoRA and precision helpers
    ("stages", ("stages", "cache_jobs", "cache_decode", "workflow", "runner", "sbatch", "estimate", "doctor", "init",
                "readme_tables", "bench", "train_job", "fits", "memory_plan", "push", "report",
                "saved_activations", "meta_denoiser")),
    ("cli", ("cli", "cli_common", "cli_cache", "__main__")),
]

_PACKAGE = Path(diffpipe.__file__).parent
_RANK = {top: rank for rank, (_, tops) in enumerate(LAYERS) for top in tops}


def _module_name(path: Path) -> str:
    parts = ["diffpipe", *path.relative_to(_PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every ``diffpipe`` module ``path`` imports (``from a import b`` counts as ``a.b``: b may be a module)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            found |= {f"{base}.{a.name}" for a in node.names} if base == "diffpipe" else {base}
    return {m for m in found if m.split(".")[0] == "diffpipe" and m != "diffpipe"}


def _top(module: str) -> str:
    return module.split(".")[1]


def _violations() -> dict[tuple[str, str], str]:
    out = {}
    for path in sorted(_PACKAGE.rglob("*.py")):
        src = _module_name(path)
        for target in _imports(path):
            if _RANK[_top(target)] > _RANK[_top(src)]:
                out[(src, target)] = f"{LAYERS[_RANK[_top(src)]][0]} -> {LAYERS[_RANK[_top(target)]][0]}"
    return out


def test_every_module_has_a_layer():
    tops = {_module_name(p).split(".")[1] for p in _PACKAGE.rglob("*.py") if p != _PACKAGE / "__init__.py"}
    assert not tops - set(_RANK), f"add these top-level modules to LAYERS: {sorted(tops - set(_RANK))}"


def test_imports_point_down():
    found = _violations()
    assert not found, "imports that point up a layer (move the code down, or the import up):\n" + "\n".join(
        f"  {src} imports {dst} ({how})" for (src, dst), how in sorted(found.items(), key=lambda kv: (kv[1], kv[0]))
    )


def test_the_benchmarks_import_names_that_exist():
    """The scripts under benchmarks/ run only when someone measures (the GPU kit: on a lent GPU): a module
    moved in the package must not leave them importing a name that is gone."""
    import importlib

    missing = []
    for path in sorted((_PACKAGE.parent / "benchmarks").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("diffpipe"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if not hasattr(module, alias.name) and importlib.util.find_spec(f"{node.module}.{alias.name}") is None:
                        missing.append(f"{path.name}: from {node.module} import {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("diffpipe"):
                        importlib.import_module(alias.name)
    assert not missing, "\n".join(missing)
