"""No giant module or function in diffpipe/ (issue "A house that is easy to change"): a module over 600 lines
or a function over 60 is split along its seams, not waved through. The limits are the whole rule."""

from __future__ import annotations

import ast
from pathlib import Path

import diffpipe

PACKAGE = Path(diffpipe.__file__).parent
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_is_over_600_lines():
    big = [f"{p.relative_to(PACKAGE)}: {n} lines" for p in _modules()
           if (n := p.read_text().count("\n")) > MAX_MODULE_LINES]
    assert not big, "split these modules along their seams:\n" + "\n".join(big)


def test_no_function_is_over_60_lines():
    long = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, "split these functions into named helpers:\n" + "\n".join(long)
