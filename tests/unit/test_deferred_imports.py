"""An import inside a function body says why it is there (STYLE.md point 14, issue #39).

Module-level imports are the rule. An import is deferred into a function only where start-up time
needs it (``diffpipe --help`` and the light commands must not pay for torch, diffusers or deepspeed),
where the dependency is optional, or where it must sit inside a ``try``; a comment on the import's
line or on the line above says which. Consecutive imports in one block share the comment of the
first. This test walks every module under ``diffpipe/`` and names each deferred import without one.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import diffpipe

_PACKAGE = Path(diffpipe.__file__).parent

# Files allowed to hold uncommented deferred imports for now: none. A file added here must say why.
NOT_YET: set[str] = set()


def _comment_lines(source: str) -> set[int]:
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {tok.start[0] for tok in tokens if tok.type == tokenize.COMMENT}


def _blocks(tree: ast.AST):
    """Every statement list inside a function body (the body itself, and those of its if/try/with/for)."""
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(fn):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    block = getattr(node, field, None)
                    if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                        yield block
                if isinstance(node, ast.Match):
                    yield from (case.body for case in node.cases)


def uncommented(source: str, filename: str = "<source>") -> list[int]:
    """Line numbers of the imports inside function bodies with no comment on their lines or the line above
    (an import directly after a commented one in the same block counts as commented)."""
    comments = _comment_lines(source)
    bare = set()
    for block in _blocks(ast.parse(source, filename)):
        covered = False
        for stmt in block:
            if not isinstance(stmt, ast.Import | ast.ImportFrom):
                covered = False
                continue
            own = any(line in comments for line in range(stmt.lineno - 1, stmt.end_lineno + 1))
            covered = own or covered
            if not covered:
                bare.add(stmt.lineno)
    return sorted(bare)


def _module_report(path: Path) -> list[str]:
    source = path.read_text()
    lines = source.splitlines()
    rel = path.relative_to(_PACKAGE.parent)
    return [f"{rel}:{n}: {lines[n - 1].strip()}" for n in uncommented(source, str(path))]


def test_every_deferred_import_says_why():
    found = []
    for path in sorted(_PACKAGE.rglob("*.py")):
        if path.relative_to(_PACKAGE).as_posix() not in NOT_YET:
            found += _module_report(path)
    assert not found, (
        "imports inside a function with no comment saying why (move them to the top of the module, or say why "
        "they are deferred on their line or the line above, e.g. `# deferred: torch takes ~2 s to import and "
        "`diffpipe --help` must not pay it`):\n" + "\n".join(f"  {f}" for f in found)
    )


def test_the_not_yet_list_only_holds_files_that_still_need_it():
    """An entry whose file is clean (or gone) must leave the list, so the list only shrinks."""
    stale = [name for name in sorted(NOT_YET)
             if not (_PACKAGE / name).is_file() or not _module_report(_PACKAGE / name)]
    assert not stale, f"remove from NOT_YET (nothing left to comment there): {stale}"


def test_the_rule_flags_a_bare_import_and_accepts_a_commented_one():
    source = '''
import json


def bare():
    import torch

    return torch


def commented_above():
    # deferred: torch takes seconds to import
    import torch
    from torch import nn

    return torch, nn


def commented_inline():
    if True:
        import torch  # deferred: optional

        x = 1
        import numpy

    try:  # deferred: optional dependency
        import wandb
    except ImportError:
        wandb = None
    return torch, numpy, x, wandb
'''
    assert uncommented(source) == [6, 24]
