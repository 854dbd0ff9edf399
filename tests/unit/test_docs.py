"""The docs: README.md and docs/*.md hold every config key, their generated tables are
current, every page is in the README's index, and every relative link resolves."""

import re
from pathlib import Path

from diffpipe.config import Config, _rows
from diffpipe.paths import REPO_ROOT
from diffpipe.readme_tables import TABLES, refresh

DOCS = REPO_ROOT / "docs"
PAGES = [REPO_ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a Markdown page, duplicates numbered as GitHub does (`x`, `x-1`, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(text):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` whose file or heading does not exist."""
    broken = []
    for line in _prose(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no file {file})")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest.read_text())):
                broken.append(f"{page.name}: {target} (no heading #{anchor} in {dest.name})")
    return broken


def test_slug_matches_github():
    assert slug("Checkpoints and resume") == "checkpoints-and-resume"
    assert slug("Safety: what is guaranteed, and what is not") == "safety-what-is-guaranteed-and-what-is-not"
    assert slug("Durable writes (`benchmarks/fsync_cost.py`)") == "durable-writes-benchmarksfsync_costpy"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


def test_every_relative_link_points_at_a_file_and_heading():
    assert (DOCS / "configuration.md").is_file()
    broken = [b for page in PAGES for b in broken_links(page)]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n[ok](#title) [ok](b.md#sub) [bad](#nope) [bad](b.md#x) [bad](c.md)\n")
    (tmp_path / "b.md").write_text("# B\n## Sub\n")
    assert [b.split(" ")[1] for b in broken_links(tmp_path / "a.md")] == ["#nope", "b.md#x", "c.md"]


def test_readme_indexes_every_docs_page():
    readme = (REPO_ROOT / "README.md").read_text()
    missing = [p.name for p in DOCS.glob("*.md") if f"](docs/{p.name})" not in readme]
    assert not missing, f"README.md's Documentation index lacks: {missing}"


def test_every_config_key_is_documented():
    """Each dotted key of the config reference is in docs/configuration.md's generated table."""
    page = (DOCS / "configuration.md").read_text()
    start, end = "<!-- config-reference:start -->\n", "\n<!-- config-reference:end -->"
    assert start in page and end in page, "docs/configuration.md lost its config reference table"
    table = page.split(start, 1)[1].split(end, 1)[0]
    keys = [key for key, _, _ in _rows(Config, "")]
    assert len(keys) > 50
    missing = [k for k in keys if f"| `{k}` |" not in table]
    assert not missing, f"docs/configuration.md does not document: {missing}"


def test_generated_tables_are_current():
    """`make docs` (python -m diffpipe.readme_tables) would change nothing."""
    for name, (_, rel) in TABLES.items():
        text = (REPO_ROOT / rel).read_text()
        assert f"<!-- {name}:start -->" in text, f"{rel} lacks the {name} table"
        assert refresh(text, [name]) == text, f"{rel}: the {name} table is stale; run `make docs`"
