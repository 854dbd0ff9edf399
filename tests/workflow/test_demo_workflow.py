"""The whole Snakemake workflow on the demo config, in a temporary folder.

Tests run in file order on one shared run: first run, LoRA checks, the
learning check, a second run that does nothing, then a caption edit.

The run's losses and exported LoRA are also compared with the golden values in
``tests/assets/golden_losses.json``; ``DIFFPIPE_UPDATE_GOLDEN=1`` rewrites them
deliberately (see ``tests/golden.py``).
"""

from __future__ import annotations

import html
import shutil
import time
import zipfile

import pytest
import torch
import yaml
from browser import render  # tests/browser.py
from rich.console import Console
from typer.testing import CliRunner

from diffpipe.cli import app
from diffpipe.config import load_config
from diffpipe.families import get_family
from diffpipe.paths import REPO_ROOT, RunPaths
from diffpipe.runner import DEFAULT_PROFILE, run_workflow
from diffpipe.sbatch import dry_run_jobs
from diffpipe.training.adapter import apply_adapter
from diffpipe.training.metrics import read_metrics

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    shutil.copytree(REPO_ROOT / "config" / "demo_data", root / "data")
    # The config is the one `diffpipe init` writes for the demo images (the README's quick start),
    # with the demo's training and sampling settings: this run proves `diffpipe run` takes it as is.
    made = CliRunner().invoke(app, ["init", str(root / "data"), "--model", "tiny:sd", "--output-dir", "run",
                                    "-o", str(root / "init.yaml"), "--no-estimate"])
    assert made.exit_code == 0, made.output
    cfg = yaml.safe_load((root / "init.yaml").read_text())
    demo_cfg = yaml.safe_load((REPO_ROOT / "config" / "demo.yaml").read_text())
    assert cfg["model"] == {"family": "sd", "flavor": "tiny"} and cfg["datasets"][0]["resolution"] == 64
    cfg.update({k: demo_cfg[k] for k in ("cache", "train", "sample")})
    # 32 steps instead of the demo's 80: enough for the learning check, 1-2 minutes less.
    cfg["train"]["epochs"] = 8
    (root / "config.yaml").write_text(yaml.safe_dump(cfg))

    def run(targets=()):
        # Two cache jobs at once: this machine has 2 cores and no GPU.
        return run_workflow(root / "config.yaml", cores=2, extra=["--resources", "gpu=2"], workdir=root,
                            console=Console(stderr=True), targets=list(targets))

    first = run()
    assert first.returncode == 0, "first workflow run failed (see the captured output)"
    return {"root": root, "run": run, "first": first, "paths": RunPaths(root / "run"),
            "cfg": load_config(root / "config.yaml")}


def test_first_run_produces_every_output(demo):
    p: RunPaths = demo["paths"]
    first = demo["first"]
    n_shards = demo["cfg"].cache.shards
    assert {"validate", "plan", "train", "export", "sample", "report"} <= {j.split("/")[0] for j in first.jobs}
    assert sum(j.startswith("cache_latents/") for j in first.jobs) == n_shards
    assert sum(j.startswith("cache_text/") for j in first.jobs) == n_shards
    for f in [p.manifest, p.report_json, p.report_html, p.plan_summary, p.adapter_file, p.metrics,
              p.export_diffusers, p.export_file("comfyui"), p.sample_grid, p.train_dir / "loss.png", p.run_report]:
        assert f.exists() and f.stat().st_size > 0, f
    assert list(p.tensorboard.glob("events.out.tfevents.*"))
    assert list(p.epoch_loras.glob("epoch-*/adapter_model.safetensors"))
    assert list(p.checkpoints.glob("step-*"))
    for shard in p.shard_names("latents"):
        assert p.latent_shard(shard).is_dir()
        assert p.text_shard(shard).is_file()
    rows = read_metrics(p.metrics)
    assert {"step", "loss", "lr", "samples_per_s"} <= set(rows[0])
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))


def test_golden_losses_and_lora(demo, golden):
    """The workflow's first 8 losses and exported LoRA equal the stored golden values (tests/golden.py)."""
    golden("sd", "test_demo_workflow::demo", demo["paths"])


def _unet_inputs(unet, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = unet.config
    x = torch.randn(2, cfg.in_channels, cfg.sample_size, cfg.sample_size, generator=g)
    ctx = torch.randn(2, 77, cfg.cross_attention_dim, generator=g)
    return x, torch.tensor([10, 500]), ctx


def test_exported_lora_loads_in_stock_pipeline_and_matches_training(demo):
    p: RunPaths = demo["paths"]
    family = get_family(demo["cfg"].model)
    pipe = family.load_pipeline()
    x, t, ctx = _unet_inputs(pipe.unet)
    with torch.no_grad():
        base = pipe.unet(x, t, encoder_hidden_states=ctx).sample
        pipe.load_lora_weights(str(p.export_diffusers))
        loaded = pipe.unet(x, t, encoder_hidden_states=ctx).sample
        trained = apply_adapter(family.load_denoiser(), p.adapter_dir)
        expected = trained(x, t, encoder_hidden_states=ctx).sample
    assert (loaded - base).abs().max() > 1e-4, "the LoRA does not change the output"
    torch.testing.assert_close(loaded, expected, rtol=1e-5, atol=1e-5)


def test_training_loss_falls(demo):
    losses = [r["loss"] for r in read_metrics(demo["paths"].metrics)]
    k = max(5, len(losses) // 5)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    assert last < 0.85 * first, f"loss did not fall enough: first {first:.4f}, last {last:.4f}"


def test_the_run_report_opens_in_a_browser_with_its_plots_and_grids(demo, tmp_path):
    """#41: the page `make demo` names last renders in headless Chromium: not blank, every plot and grid
    decoded, the demo's prompts shown as text."""
    page = demo["paths"].run_report
    text = page.read_text()
    for prompt in demo["cfg"].sample.prompts:
        assert html.escape(prompt) in text
    shown = render(page, tmp_path)
    assert shown.colours > 200, "the screenshot is (nearly) one colour: a blank page"
    # loss, eval per quantile, speed, the sample grid
    assert len(shown.image_widths) >= 4 and all(w > 0 for w in shown.image_widths), shown.image_widths


def test_snakemake_report_bundles_the_run_report_and_samples(demo, tmp_path):
    """`diffpipe run -c CFG -- --report FILE` (Snakemake's --report) on the finished run: its zip holds the
    outputs the rules mark report(): the run report and the sample images."""
    bundle = tmp_path / "snakemake-report.zip"
    done = run_workflow(demo["root"] / "config.yaml", cores=1, workdir=demo["root"], console=Console(stderr=True),
                        extra=["--report", str(bundle)])
    assert done.returncode == 0 and done.jobs == []
    names = zipfile.ZipFile(bundle).namelist()
    assert any("/data/" in n and n.endswith("/report.html") for n in names), names
    assert any(n.endswith("/grid.png") for n in names), names


def test_second_run_executes_zero_jobs(demo):
    second = demo["run"]()
    assert second.returncode == 0
    assert second.jobs == []


def test_caption_edit_reruns_only_its_text_shard_and_downstream(demo):
    """After a caption edit, validate and plan rerun; then Snakemake's own plan of the rest
    (its dry run, the same decision a full run takes) is one text shard and what follows it.
    Building that shard for real is test_safety_workflow.py's last test (--target on the stale text
    shard after a caption edit: validate, plan and that shard run, and it holds the new caption), so
    this run pays for no cache job; training again is left out (the first run trained)."""
    root, p = demo["root"], demo["paths"]
    caption = sorted((root / "data").glob("*.txt"))[3]
    time.sleep(1.1)  # coarse file-system clocks
    caption.write_text(caption.read_text().strip() + ", sharp edges\n")
    third = demo["run"](targets=["plan"])
    assert third.returncode == 0
    assert sorted(third.jobs) == ["plan", "validate"]
    planned = [f"{j.rule}/{j.wildcards.removeprefix('shard=')}".rstrip("/")
               for j in dry_run_jobs(root / "config.yaml", DEFAULT_PROFILE, root)]
    text_jobs = [j for j in planned if j.startswith("cache_text/")]
    assert len(text_jobs) == 1, planned
    assert not [j for j in planned if j.startswith("cache_latents/")], planned
    assert {"train", "export", "sample"} <= {j.split("/")[0] for j in planned}, planned
    # The stale shard's spec (rewritten by the plan) holds the new caption.
    spec = yaml.safe_load(p.text_spec(text_jobs[0].split("/")[1]).read_text())
    assert any(item["caption"].endswith("sharp edges") for item in spec["items"])
