"""The run report: one self-contained HTML page per run (``<output_dir>/report.html``).

It gathers what the run's stages wrote: the validation summary (and a link to the full validation
report), cache statistics, the loss and evaluation curves, the sample images at each sampling step
with their prompts, throughput and memory, the config training ran with, and the lineage (dataset
digest, base model and weight fingerprint, diffpipe version and commit, every exported file with its
SHA-256 and how to load it). ``diffpipe report -c CFG`` writes it; so does the workflow's last rule.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from diffpipe.paths import RunPaths
from diffpipe.report import figures, gather, lineage
from diffpipe.report import page as P
from diffpipe.utils import claim_files, read_marker, write_marker, write_text_atomic

__all__ = ["ReportResult", "build_report"]


@dataclass(frozen=True)
class ReportResult:
    path: Path
    sections: list[str]
    bytes: int


def build_report(paths: RunPaths, *, prompts: list[str], sampling: str = "", out: Path | None = None) -> ReportResult:
    """Write the run report of the run at ``paths`` (default ``<output_dir>/report.html``).

    ``prompts``: the sample prompts of today's config (``sample.prompts``), shown under the sample
    stage's images; the training-time rows show the prompts training sampled with. ``sampling``: the steps
    and guidance scale the sample stage renders with, and where they come from, shown with its images. A file the run
    has not written yet leaves its section saying so. A ``report.html`` diffpipe did not write is
    never replaced (:func:`diffpipe.utils.claim_files`).
    """
    out = Path(out) if out is not None else paths.root / "report.html"
    _restamp_if_unedited(out)
    claim_files(out.parent, [out.name])  # before any work: a user's file of that name stops it here
    config_file, config = gather.run_config(paths)
    rows = gather.metrics(paths)  # read once: a long run's file holds a line per step
    sections = [
        ("overview", "Overview", _overview(paths, config, rows)),
        ("validation", "Validation", _validation(paths, out)),
        ("cache", "Cache", _cache(paths)),
        ("curves", "Loss and evaluation", _curves(rows, config)),
        ("speed", "Throughput and memory", _speed(paths, rows)),
        ("samples", "Samples", _samples(paths, prompts, config, sampling)),
        ("lineage", "Lineage", _lineage(paths, config)),
        ("config", "Config", _config(config_file, paths)),
    ]
    when = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = _sealed(P.page(f"diffpipe run report: {paths.root.name}", f"{paths.root.resolve()} · written {when}",
                          sections))
    write_text_atomic(out, text)
    return ReportResult(out, [a for a, _, _ in sections], len(text.encode()))


_SEAL = re.compile(rb"<!DOCTYPE html>\n<!-- diffpipe run report, sha256 of what follows: ([0-9a-f]{64}) -->\n")


def _sealed(body: str) -> str:
    """The page under a first comment holding the SHA-256 of the rest: an edit anywhere shows."""
    return f"<!DOCTYPE html>\n<!-- diffpipe run report, sha256 of what follows: " \
           f"{hashlib.sha256(body.encode()).hexdigest()} -->\n{body}"


def _restamp_if_unedited(out: Path) -> None:
    """Record the current time of a page diffpipe wrote there and nobody edited since.

    Snakemake touches a job's outputs after the job (their times after the inputs'), so the time
    recorded for the page the report rule wrote is older than the file's, and the folder's record
    alone would call it a user's file. A page its folder's record names, whose seal still matches
    its content, is diffpipe's page as written: its record is brought up to date. Anything else
    (an edited page, a user's file) is left to :func:`~diffpipe.utils.claim_files` to refuse.
    """
    marker = read_marker(out.parent)
    recorded = (marker or {}).get("entries", {}).get(out.name)
    if not recorded or not out.is_file() or out.is_symlink():
        return
    data = out.read_bytes()
    seal = _SEAL.match(data)
    if seal is None or hashlib.sha256(data[seal.end():]).hexdigest() != seal[1].decode():
        return
    st = out.stat()
    write_marker(out.parent, {**marker["entries"], out.name: {**recorded, "size": st.st_size,
                                                               "mtime_ns": st.st_mtime_ns}}, marker)


def _missing(what: str, command: str) -> str:
    return f"<p class=muted>{P.esc(what)} not written yet (<code>{P.esc(command)}</code> writes it).</p>"


def _overview(paths: RunPaths, config: dict, rows: list[dict]) -> str:
    model = config.get("model") or {}
    losses = [r["loss"] for r in rows if isinstance(r.get("loss"), (int, float))]
    facts = {
        "model": f"{model.get('family', '?')} ({model.get('flavor', '?')} flavor)"
                 + (f", {model['path']}" if model.get("path") else ""),
        "steps trained": rows[-1]["step"] if rows else "none yet",
        "loss, first → last step": f"{losses[0]:.4g} → {losses[-1]:.4g}" if losses else "—",
        "LoRA (diffusers)": str(paths.export_diffusers.relative_to(paths.root)) if paths.export_diffusers.exists()
        else "not exported yet",
    }
    return P.pairs(facts)


def _validation(paths: RunPaths, out: Path) -> str:
    data = gather.validation(paths)
    if not data:
        return _missing("validate/report.json", "diffpipe validate -c CFG")
    link = Path(paths.report_html).resolve()
    try:
        href = link.relative_to(out.parent.resolve()).as_posix()
    except ValueError:
        href = link.as_uri()
    body = P.pairs(data["summary"])
    if data["datasets"]:
        keys = sorted({k for d in data["datasets"].values() for k in d})
        body += P.table(["dataset", *keys], [[n, *(d.get(k, "") for k in keys)] for n, d in data["datasets"].items()])
    if data["counts"]:
        body += P.table(["reason", "files"], [[k, v] for k, v in sorted(data["counts"].items())])
    return body + f'<p>Every flagged file, with thumbnails: <a href="{P.esc(href)}">{P.esc(href)}</a></p>'


def _cache(paths: RunPaths) -> str:
    stats = gather.cache_stats(paths)
    if not stats:
        return _missing("cache/*/*.summary.json", "diffpipe cache latents|text -c CFG --shard sNNNN")
    rows = [[kind, int(s["shards"]), int(s["items"]), int(s["encoded"]), int(s["reused"]), round(s["wall_s"], 2)]
            for kind, s in sorted(stats.items())]
    return (P.table(["kind", "shards", "items", "encoded", "reused from the store", "seconds (sum)"], rows)
            + "<p class=muted>Reused entries were copied from the content-addressed store, not encoded again.</p>")


def _objective(config: dict) -> str:
    return str(((config.get("train") or {}).get("objective") or {}).get("loss") or "mse")


def _curves(rows: list[dict], config: dict) -> str:
    if not rows:
        return _missing("train/metrics.jsonl", "diffpipe train -c CFG")
    body = P.img(figures.loss_png(rows, _objective(config)), "loss per step", "plot")
    if ev := figures.eval_png(rows, _objective(config)):
        body += P.img(ev, "evaluation loss per timestep quantile", "plot")
    return body


def _speed(paths: RunPaths, rows: list[dict]) -> str:
    summary = gather.read_json(paths.train_dir / "summary.json")
    body = P.pairs(gather.throughput(rows, summary)) if rows or summary else _missing("train/", "diffpipe train")
    if chart := figures.speed_png(rows):
        body += P.img(chart, "throughput and peak memory per step", "plot")
    if times := gather.stage_times(paths):
        body += "<h3>Time and memory per job (Snakemake benchmarks)</h3>" + P.table(
            ["job", "seconds", "peak resident memory (MB)"], [[t["job"], t["seconds"], t["max_rss_mb"]] for t in times])
    return body


def _samples(paths: RunPaths, prompts: list[str], config: dict, sampling: str = "") -> str:
    body = ""
    if paths.sample_grid.is_file():
        listed = "".join(f"<li>{P.esc(p)}</li>" for p in prompts)
        how = f"<p class=muted>Sampled with {P.esc(sampling)}.</p>" if sampling else ""
        body += ("<h3>After training (diffpipe sample): base model above, with the LoRA below</h3>"
                 f'{P.img(figures.file_png(paths.sample_grid, figures.MAX_GRID), "sample grid", "grid")}{how}'
                 f"<ol>{listed}</ol>")
    else:
        body += _missing("samples/grid.png", "diffpipe sample -c CFG")
    trained_prompts = list(((config.get("sample") or {}).get("prompts")) or prompts)
    rows = gather.step_samples(paths)
    shown = figures.pick_steps([s for s, _ in rows])
    if rows:
        body += (f"<h3>During training: {len(shown)} of {len(rows)} sampling steps</h3>"
                 "<p class=muted>The in-training weights, same seed at every step.</p>")
    for step, f in rows:
        if step not in shown:
            continue
        cells = figures.tiles(f, len(trained_prompts))
        caps = trained_prompts if len(cells) == len(trained_prompts) else [" | ".join(trained_prompts)]
        body += (f"<h4>step {step}</h4><div class=tiles>"
                 + "".join(P.figure(png, cap) for png, cap in zip(cells, caps, strict=True)) + "</div>")
    return body


def _config(config_file: Path | None, paths: RunPaths) -> str:
    if config_file is None:
        return _missing("the run's config", "diffpipe run -c CFG")
    rel = config_file.relative_to(paths.root) if config_file.is_relative_to(paths.root) else config_file
    return (f"<p>The config training ran with ({P.esc(rel)}), every default filled in:</p>"
            f"<pre>{P.esc(config_file.read_text(errors='replace'))}</pre>")


def _lineage(paths: RunPaths, config: dict) -> str:
    return _lineage_facts(paths, config) + _exports(paths, config)


def _lineage_facts(paths: RunPaths, config: dict) -> str:
    data = lineage.dataset_digest(paths.manifest)
    header = lineage.export_header(paths)
    base = header.get("base_model") or {}
    model = config.get("model") or {}
    code = lineage.code_version()
    facts = {
        "dataset digest (SHA-256 over each kept item's id and content hashes)":
            f"{data['sha256']} ({data['items']} of {data['of']} items)" if data else "no manifest yet",
        "datasets": ", ".join(f"{d.get('name')}: {d.get('hub') or d.get('path')}"
                              + (f" @ {d['revision']}" if d.get("revision") else "")
                              for d in config.get("datasets") or []) or "—",
        "model": f"{model.get('family', '?')}, flavor {model.get('flavor', '?')}, "
                 f"{model.get('path') or 'built from its seed (no download)'}",
        "model revision": model.get("revision") or ("main" if model.get("path") else "—"),
        "base weights fingerprint (SHA-256, from the exported files' header)": base.get("weights_sha256", "—"),
        "diffpipe version": code["version"],
        "diffpipe commit (the code that wrote this report)": code["commit"],
    }
    return P.pairs(facts)


def _exports(paths: RunPaths, config: dict) -> str:
    files = lineage.exported_files(paths)
    if not files:
        return _missing("export/", "diffpipe export -c CFG")
    family = (config.get("model") or {}).get("family")
    pipeline = _pipeline_name(family)
    rows = "".join(
        f"<tr><td>{P.esc(f.fmt)}</td><td><code>{P.esc(f.rel)}</code></td><td class=num>{f.size:,}</td>"
        f"<td><code>{P.esc(f.sha256)}</code></td><td>{P.code_text(lineage.how_to_load(f, family, pipeline))}</td></tr>"
        for f in files)
    return ("<h3>Exported files</h3><table class=files><thead><tr><th>format</th><th>file</th><th>bytes</th><th>SHA-256</th>"
            f"<th>how to load</th></tr></thead><tbody>{rows}</tbody></table>")


def _pipeline_name(family: str | None) -> str:
    """The diffusers pipeline class of ``family`` (for the how-to-load lines), or a description."""
    if not family:
        return "the pipeline"
    # deferred: the family modules import diffusers
    from diffpipe.families import spec

    try:
        cls = getattr(spec(family).family_type(), "pipeline_class", None)
    except Exception:  # noqa: BLE001 - an unknown family still gets the rest of its report
        return "the pipeline"
    return cls.__name__ if isinstance(cls, type) else "the pipeline"

