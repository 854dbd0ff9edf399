"""Which families each stage module runs, from the registry, and the rows its tables must hold.

A plain module (not a conftest), so stage modules import it by one name. A new family is in the generic
image or video module's list without an edit; a table row it lacks is a failure naming the family, the
table and what the row holds (:func:`row`), not a ``KeyError``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pytest

from diffpipe.families import family_names, spec

#: Families whose end-to-end stage run lives in a module of its own (their inputs need more than the
#: generic modules give: control images, experts, the demo workflow), so the generic modules leave them out.
OWN_MODULE = {
    "sd": "tests/workflow/test_demo_workflow.py",
    "flux": "tests/stages/test_flux_end_to_end.py",
    "flux-kontext": "tests/stages/test_flux_kontext.py",
    "flux-control": "tests/stages/test_flux_control.py",
    "qwenimage-edit": "tests/stages/test_qwenimage_edit.py",
    "wan": "tests/stages/test_wan_end_to_end.py",
}


def _video(name: str) -> bool:
    return spec(name).family_type().is_video


def image_families() -> list[str]:
    """Every registered image family without a module of its own (``tests/stages/test_image_families.py``)."""
    return [n for n in family_names() if n not in OWN_MODULE and not _video(n)]


def video_families() -> list[str]:
    """Every registered video family without a module of its own (``tests/stages/test_video_families.py``)."""
    return [n for n in family_names() if n not in OWN_MODULE and _video(n)]


def missing_rows(names: Iterable[str], table: Mapping[str, Any], where: str, holds: str) -> list[str]:
    """One line per family of ``names`` without a row in ``table`` (``where``: the table's name and file;
    ``holds``: what a row holds)."""
    return [f"family {n!r} has no row in {where}: add `{n!r}: {holds}`" for n in names if n not in table]


def row(table: Mapping[str, Any], name: str, where: str, holds: str) -> Any:
    """``table[name]``; a failure saying which row to add when the family has none."""
    if name not in table:
        pytest.fail(missing_rows([name], table, where, holds)[0], pytrace=False)
    return table[name]
