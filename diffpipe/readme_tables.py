"""Refresh the README's generated tables in place: ``python -m diffpipe.readme_tables README.md``.

Each table sits between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``
markers; tests check the README against the same generators.
"""

from __future__ import annotations

import sys
from pathlib import Path

from diffpipe.config import reference_markdown
from diffpipe.data.policy import policy_markdown
from diffpipe.utils import write_text_atomic

TABLES = {"config-reference": reference_markdown, "validation-reasons": policy_markdown}


def refresh(text: str) -> str:
    for name, make in TABLES.items():
        start, end = f"<!-- {name}:start -->\n", f"\n<!-- {name}:end -->"
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = head + start + make().strip() + end + tail
    return text


def main(path: str) -> None:
    readme = Path(path)
    write_text_atomic(readme, refresh(readme.read_text()))


if __name__ == "__main__":
    main(sys.argv[1])
