"""The run report (diffpipe.report) on a synthetic run folder: every section, escaped user text, inline
images, lineage, and the page as headless Chromium renders it."""

from __future__ import annotations

import hashlib
import json
import re

import numpy as np
import pytest
import torch
import yaml
from browser import render  # tests/browser.py
from PIL import Image
from safetensors.torch import save_file

from diffpipe.paths import RunPaths
from diffpipe.report import build_report
from diffpipe.utils import NotOurFolderError

HOSTILE = "<script>alert(1)</script>"
PROMPTS = [f"a red circle {HOSTILE}", "a yellow square & a \"quoted\" word"]


def _png(path, size=(32, 32), seed=0):
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path)


@pytest.fixture
def run(tmp_path) -> RunPaths:
    """A finished run's files, as the stages write them (small and made up)."""
    p = RunPaths(tmp_path / "run")
    p.report_json.parent.mkdir(parents=True)
    p.report_json.write_text(json.dumps({"summary": {"items": 3, "kept": 2, "skipped": 1, "errors": 0},
                                         "datasets": {f"d{HOSTILE}": {"items": 3, "kept": 2}},
                                         "counts": {"corrupt_image": 1}}))
    p.report_html.write_text("<html>validation</html>")
    for kind, ext in (("latents", "zarr"), ("text", "arrow")):
        for i, (enc, reused) in enumerate([(2, 0), (0, 2)]):
            f = p.root / "cache" / kind / f"s000{i}.{ext}.summary.json"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(json.dumps({"kind": kind, "items": 2, "encoded": enc, "reused": reused, "wall_s": 0.5}))
    p.train_dir.mkdir(parents=True)
    rows = [{"step": s, "loss": 1 / s, "samples_per_s": 10.0 + s % 3, "peak_memory_mb": 700 + s,
             "step_time": 0.1} for s in range(1, 21)]
    for s in (10, 20):
        rows[s - 1].update({"eval_loss": 0.5 / s, "eval_loss_q0.1": 0.4 / s, "eval_loss_q0.9": 0.6 / s})
    p.metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (p.train_dir / "summary.json").write_text(json.dumps({"steps": 20, "seconds": 2.0, "world_size": 1}))
    config = {"output_dir": str(p.root), "model": {"family": "sd", "flavor": "tiny"},
              "datasets": [{"name": "d", "path": "/data"}], "train": {"objective": {"loss": "mse"}},
              "sample": {"prompts": PROMPTS}}
    (p.train_dir / "config.yaml").write_text(yaml.safe_dump(config))
    for step in (10, 20):
        _png(p.train_dir / "samples" / f"step-{step:06d}.png", (64, 32), seed=step)
    _png(p.sample_grid, (400, 300))
    p.export_dir.mkdir()
    header = {"diffpipe.base_model": json.dumps({"family": "sd", "weights_sha256": "ab" * 32})}
    save_file({"w": torch.ones(2)}, str(p.export_diffusers), metadata=header)
    (p.export_dir / "README.md").write_text("# card\n")
    return p


def test_the_report_shows_every_section_with_user_text_escaped(run):
    result = build_report(run, prompts=PROMPTS)
    text = result.path.read_text()
    assert result.path == run.run_report
    assert result.sections == ["overview", "validation", "cache", "curves", "speed", "samples", "lineage", "config"]
    # No script, no element from the user's text: the prompt is shown as text.
    assert "<script" not in text.lower()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "a yellow square &amp; a &quot;quoted&quot; word" in text
    # Self-contained: every image inline; the only link is the full validation report, relative.
    sources = re.findall(r'<img src="([^"]*)"', text)
    assert sources and all(s.startswith("data:image/png;base64,") for s in sources)
    # loss, eval, speed, the sample grid, two prompts at each of two sampling steps
    assert len(sources) == 3 + 1 + 2 * 2
    assert re.findall(r'href="([^#"][^"]*)"', text) == ["validate/report.html"]
    # Lineage: the exported file's digest as it is, the weight fingerprint from its header.
    digest = hashlib.sha256(run.export_diffusers.read_bytes()).hexdigest()
    assert digest in text and "ab" * 32 in text
    assert "load_lora_weights" in text  # the model card's how-to-load line
    assert "diffpipe version" in text and "dataset digest" in text
    # Cache statistics summed over shards.
    assert re.search(r"<td>latents</td><td class=num>2</td><td class=num>4</td><td class=num>2</td>"
                     r"<td class=num>2</td>", text)


def test_the_report_says_what_the_samples_rendered_with(run):
    """``sampling`` (:func:`diffpipe.families.sampling.sampling_note`: resolved steps and guidance, and where each
    comes from) is shown with the sample grid, escaped."""
    note = "4 steps (FLUX.1-schnell's default: model card), guidance scale 0 (<set> in the config)"
    text = build_report(run, prompts=PROMPTS, sampling=note).path.read_text()
    assert ("Sampled with 4 steps (FLUX.1-schnell&#x27;s default: model card), guidance scale 0 (&lt;set&gt; in the "
            "config).") in text


def test_a_report_of_a_run_that_has_only_validated_says_what_is_missing(tmp_path):
    p = RunPaths(tmp_path / "run")
    p.report_json.parent.mkdir(parents=True)
    p.report_json.write_text(json.dumps({"summary": {"items": 1}}))
    text = build_report(p, prompts=["x"]).path.read_text()
    assert "train/metrics.jsonl not written yet" in text and "diffpipe export -c CFG" in text


def test_a_users_report_html_is_never_replaced(run):
    run.run_report.write_text("my notes")
    with pytest.raises(NotOurFolderError, match="report.html"):
        build_report(run, prompts=PROMPTS)
    assert run.run_report.read_text() == "my notes"


@pytest.mark.slow  # three Chromium launches: `make test`, not the edit loop's `make test-fast`
def test_the_report_renders_in_headless_chromium(run, tmp_path):
    """The page as a browser shows it: not blank, every image decoded (a broken one is caught)."""
    page = build_report(run, prompts=PROMPTS).path
    shown = render(page, tmp_path)
    assert shown.colours > 200, "the screenshot is (nearly) one colour: a blank page"
    assert len(shown.image_widths) == 8 and all(w > 0 for w in shown.image_widths), shown.image_widths
    # The check can fail: a page whose image data is damaged reads back a 0 width.
    broken = tmp_path / "broken.html"
    broken.write_text(re.sub(r'src="data:image/png;base64,[^"]{40}', 'src="data:image/png;base64,AAAA', page.read_text(),
                             count=1))
    assert 0 in render(broken, tmp_path).image_widths
    blank = tmp_path / "blank.html"
    blank.write_text("<!DOCTYPE html><html><body></body></html>")
    assert render(blank, tmp_path).colours < 10


def test_diffpipe_run_ends_by_naming_the_report(run):
    """`make demo` (diffpipe run) ends its summary with the page to open."""
    import io

    from rich.console import Console

    from diffpipe.runner import RunSummary, _print_summary

    build_report(run, prompts=PROMPTS)
    out = io.StringIO()
    _print_summary(Console(file=out, width=300), RunSummary(0, ["report"], {"report": 1.0}, 1.0), run)
    assert out.getvalue().strip().splitlines()[-1] == f"run report (open it in a browser): {run.run_report}"


def test_a_long_run_shows_at_most_twelve_sampling_steps():
    """Hundreds of sample rows would make the page hundreds of megabytes: 12 steps, evenly spaced, ends kept."""
    from diffpipe.report.figures import MAX_STEP_ROWS, pick_steps

    steps = list(range(50, 50 * 201, 50))
    shown = pick_steps(steps)
    assert len(shown) == MAX_STEP_ROWS == 12 and shown[0] == 50 and shown[-1] == 10000
    assert pick_steps([5, 10]) == [5, 10]


def test_the_report_rebuilds_after_snakemake_touched_it(run):
    """Snakemake touches a job's outputs after it (their times after the inputs'), so the time recorded for
    the page the report rule wrote is older than the file's: `diffpipe report -c CFG` still rebuilds it.
    An edit that changes the page (its size) is still a user's file, never replaced."""
    import os

    page = build_report(run, prompts=PROMPTS).path
    st = page.stat()
    os.utime(page, ns=(st.st_atime_ns, st.st_mtime_ns + 6_000_000_000))
    assert build_report(run, prompts=PROMPTS).path == page
    page.write_text(page.read_text() + "<p>my note</p>")
    with pytest.raises(NotOurFolderError, match="report.html"):
        build_report(run, prompts=PROMPTS)
