"""The run report as one self-contained HTML page: every picture inline (data URIs), no script, no
outside request. Every piece of text from the run (prompts, paths, config values) goes through
:func:`html.escape`, so a prompt such as ``<script>`` is shown, never run."""

from __future__ import annotations

import base64
import html
from typing import Any

_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1100px;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ddd;padding:.25em .6em;text-align:left;
vertical-align:top}th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
code,pre{font-family:ui-monospace,monospace;font-size:.9em}pre{background:#f6f8fa;padding:.8em;overflow:auto;
max-height:32em}.tiles{display:flex;flex-wrap:wrap;gap:12px}figure{margin:0;width:200px}
figure img{width:200px;height:auto;image-rendering:pixelated;border:1px solid #ccc;display:block}
figcaption{font-size:.85em;line-height:1.25;margin-top:.3em;overflow-wrap:anywhere}
img.plot{max-width:100%;height:auto;display:block}img.grid{max-width:100%;image-rendering:pixelated}
.muted{color:#666}nav a{margin-right:.8em}td code{overflow-wrap:anywhere}table.files{width:100%}
table.files td:nth-child(4){font-size:.8em;word-break:break-all;min-width:16em}
"""


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def img(png: bytes, alt: str, cls: str = "") -> str:
    klass = f' class="{esc(cls)}"' if cls else ""
    return f'<img src="{data_uri(png)}" alt="{esc(alt)}"{klass}>'


def fmt(value: Any) -> str:
    """A number at a readable precision, anything else as text (escaped)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return esc(value)
    return esc(f"{value:,}" if isinstance(value, int) else f"{value:,.4g}")


def table(header: list[str], rows: list[list[Any]]) -> str:
    """A table; cells are escaped text, numbers right-aligned."""
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f'<td{" class=num" if isinstance(c, (int, float)) and not isinstance(c, bool) else ""}>'
                         f"{fmt(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def pairs(items: dict[str, Any]) -> str:
    return table(["", ""], [[k, v] for k, v in items.items()]).replace("<thead><tr><th></th><th></th></tr></thead>", "")


def code_text(text: str) -> str:
    """Markdown-ish text with `code` spans (the model card's how-to-load lines), escaped piece by piece."""
    parts = text.split("`")
    return "".join(f"<code>{esc(p)}</code>" if i % 2 else esc(p) for i, p in enumerate(parts))


def figure(png: bytes, caption: str) -> str:
    return f"<figure>{img(png, caption)}<figcaption>{esc(caption)}</figcaption></figure>"


def section(anchor: str, title: str, body: str) -> str:
    return f'<section id="{esc(anchor)}"><h2>{esc(title)}</h2>{body}</section>'


def page(title: str, subtitle: str, sections: list[tuple[str, str, str]]) -> str:
    """The page from ``<html>`` on (the caller seals it under the doctype): a title, a table of contents, then
    each ``(anchor, title, body html)`` section."""
    nav = "".join(f'<a href="#{esc(a)}">{esc(t)}</a>' for a, t, _ in sections)
    body = "".join(section(a, t, b) for a, t, b in sections)
    return (f'<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{esc(title)}</title><style>{_CSS}</style></head><body>"
            f"<h1>{esc(title)}</h1><p class=muted>{esc(subtitle)}</p><nav>{nav}</nav>{body}</body></html>\n")
