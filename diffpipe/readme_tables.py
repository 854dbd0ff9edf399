"""Refresh the generated tables of the docs in place: ``python -m diffpipe.readme_tables``.

Each table sits between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``
markers in the file ``TABLES`` names for it (relative to the repository root,
or to the folder given as the one argument); tests check the docs against the
same generators.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from diffpipe.config import reference_markdown
from diffpipe.families.tables import (
    families_markdown,
    formats_markdown,
    not_implemented_markdown,
    pipeline_markdown,
    sampling_markdown,
)
from diffpipe.policy import policy_markdown
from diffpipe.utils import write_text_atomic


def _memory_fits() -> str:
    from diffpipe.fits import fits_markdown  # builds models on the meta device: import torch only here

    return fits_markdown()


#: Table name -> (generator, file that holds the table, relative to the repository root).
TABLES: dict[str, tuple[Callable[[], str], str]] = {
    "config-reference": (reference_markdown, "docs/configuration.md"),
    "validation-reasons": (policy_markdown, "docs/validation.md"),
    "families": (families_markdown, "docs/families.md"),
    "not-implemented": (not_implemented_markdown, "docs/families.md"),
    "family-formats": (formats_markdown, "docs/formats.md"),
    "pipeline-families": (pipeline_markdown, "docs/training.md"),
    "sampling-defaults": (sampling_markdown, "docs/training.md"),
}
#: Tables too slow to rebuild in every test run (the memory table sizes 14 published models on the
#: meta device, about 6 s of CPU time a row for FLUX.1-dev and Qwen-Image, each row's denoisers freed
#: before the next: benchmarks/plan_memory_reuse.py): ``make docs`` refreshes them;
#: tests/unit/test_memory_plan.py checks the FLUX.1-dev row against the estimate.
SLOW_TABLES: dict[str, tuple[Callable[[], str], str]] = {
    "memory-fits": (_memory_fits, "docs/training.md"),
}

REPO_ROOT = Path(__file__).resolve().parents[1]


def refresh(text: str, names: list[str] | None = None) -> str:
    """``text`` with the tables ``names`` (default: all) regenerated between their markers."""
    tables = {**TABLES, **SLOW_TABLES}
    for name in tables if names is None else names:
        make = tables[name][0]
        start, end = f"<!-- {name}:start -->\n", f"\n<!-- {name}:end -->"
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = head + start + make().strip() + end + tail
    return text


def main(root: str | Path = REPO_ROOT) -> None:
    by_file: dict[str, list[str]] = {}
    for name, (_, rel) in {**TABLES, **SLOW_TABLES}.items():
        by_file.setdefault(rel, []).append(name)
    for rel, names in by_file.items():
        path = Path(root) / rel
        write_text_atomic(path, refresh(path.read_text(), names))


if __name__ == "__main__":
    main(*sys.argv[1:2])
