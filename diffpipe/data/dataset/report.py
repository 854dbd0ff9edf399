"""Validation reports: JSON for machines and a self-contained HTML page."""

from __future__ import annotations

import base64
import html
import io
import json
import os
import re
from pathlib import Path
from typing import Any

from diffpipe.data.dataset.media import thumbnail
from diffpipe.data.dataset.results import Issue, ValidationResult
from diffpipe.utils import digest, write_text_atomic

#: Bump when the page layout changes, so existing pages are rebuilt.
HTML_VERSION = 3  # 3: thumbnails only of files within the pixel limits
THUMB = 128
#: Thumbnails per reason; the rest are listed without one (keeps the page small).
MAX_THUMBS = 500
#: Larger images get no thumbnail (nor more than ``validation.max_pixels``): a page of
#: flagged files must not cost a decode of each at full size.
THUMB_MAX_PIXELS = 64_000_000
#: Reasons whose files are fine to look at: no thumbnail needed.
_NO_THUMB = {"large_media"}
_KEY_RE = re.compile(r'<meta name="diffpipe-report-key" content="([0-9a-f]+)">')


def _write_or_touch(path: Path, text: str) -> bool:
    """Write ``text`` atomically unless the file holds it; otherwise only bump the mtime."""
    if path.is_file() and path.read_text(errors="replace") == text:
        os.utime(path)
        return False
    write_text_atomic(path, text)
    return True


def report_data(result: ValidationResult) -> dict[str, Any]:
    """The JSON report: totals, counts per reason and one entry per flagged file."""
    return {
        "summary": {
            "items": result.items,
            "kept": result.kept,
            "skipped": result.skipped,
            "warnings": result.warnings,
            "errors": result.errors,
        },
        "datasets": result.datasets,
        "counts": result.counts,
        "issues": [
            {
                "dataset": i.dataset,
                "path": i.path,
                "reason": i.reason,
                "action": i.action,
                "message": i.message,
            }
            for i in result.issues
        ],
    }


def _thumbnail(path: str, kind: str | None, max_pixels: int) -> str | None:
    """Base64 JPEG thumbnail (a video's first frame), or None when it cannot be decoded."""
    img = thumbnail(path, kind, THUMB, min(max_pixels, THUMB_MAX_PIXELS))
    if img is None:
        return None
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=80)
    return base64.b64encode(buf.getvalue()).decode()


_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 10px;text-align:left}
.grid{display:flex;flex-wrap:wrap;gap:12px}
.card{width:150px;font-size:12px;word-break:break-all}
.card img,.ph{width:128px;height:128px;object-fit:contain;background:#eee;display:block}
.ph{display:flex;align-items:center;justify-content:center;color:#888;border:1px dashed #aaa}
.skip{color:#b36b00}.warn{color:#666}.error{color:#c00}
"""


def _card(issue: Issue, with_thumb: bool, max_pixels: int) -> str:
    name = html.escape(Path(issue.path).name)
    msg = html.escape(issue.message)
    label = (
        None if issue.kind else "no media"
    )  # flags on rows have a kind; others name a file or folder
    thumb = None
    if label is None:
        thumb = _thumbnail(issue.path, issue.kind, max_pixels) if with_thumb else None
        label = "cannot decode" if with_thumb else "not shown"
    if thumb:
        pic = f'<img src="data:image/jpeg;base64,{thumb}" alt="{name}">'
    else:
        pic = f'<div class="ph">{label}</div>'
    return f'<div class="card" title="{html.escape(issue.path)}">{pic}<b>{name}</b><br>{msg}</div>'


def render_html(result: ValidationResult, key: str) -> str:
    """A self-contained page: summary table, then flagged files grouped by reason."""
    data = report_data(result)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f'<meta name="diffpipe-report-key" content="{key}">',
        f"<title>diffpipe validation</title><style>{_CSS}</style></head><body>",
        "<h1>Dataset validation</h1><table><tr><th></th><th>files</th></tr>",
    ]
    parts += [f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in data["summary"].items()]
    parts.append(
        "</table><h2>Datasets</h2><table><tr><th>dataset</th><th>items</th><th>kept</th><th>skipped</th>"
        "<th>eval</th></tr>"
    )
    for name, c in data["datasets"].items():
        parts.append(
            f"<tr><td>{html.escape(name)}</td><td>{c['items']}</td><td>{c['kept']}</td><td>{c['skipped']}</td><td>{c['eval']}</td></tr>"
        )
    parts.append("</table>")
    if not result.issues:
        parts.append("<p>No problems found.</p>")
    for reason, count in data["counts"].items():
        action = result.actions[reason]
        parts.append(
            f'<h2 id="{reason}">{reason} <span class="{action}">({action}, {count})</span></h2><div class="grid">'
        )
        group = [i for i in result.issues if i.reason == reason]
        with_thumbs = reason not in _NO_THUMB
        parts += [_card(issue, with_thumbs and n < MAX_THUMBS, result.max_pixels) for n, issue in enumerate(group)]
        parts.append("</div>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def write_reports(result: ValidationResult, *, report_json: Path, report_html: Path) -> None:
    """Write both reports; unchanged ones are only touched (the HTML is not re-rendered)."""
    data = report_data(result)
    _write_or_touch(
        report_json, json.dumps(data, indent=1, sort_keys=True, ensure_ascii=False) + "\n"
    )
    # The page depends on the report and on the flagged files' content; its key
    # lets an unchanged rerun skip re-reading those images for thumbnails.
    key = digest([HTML_VERSION, data, [i.sha256 for i in result.issues]])
    if report_html.is_file():
        with open(report_html, encoding="utf-8", errors="replace") as f:
            m = _KEY_RE.search(f.read(4096))
        if m and m.group(1) == key:
            os.utime(report_html)
            return
    write_text_atomic(report_html, render_html(result, key))
