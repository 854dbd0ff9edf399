"""The whole Snakemake workflow on the demo config, in a temporary folder.

Tests run in file order on one shared run: first run, LoRA checks, the
learning check, a second run that does nothing, then a caption edit.

The run's losses and exported LoRA are also compared with the golden values in
``tests/assets/golden_losses.json``; ``DIFFPIPE_UPDATE_GOLDEN=1`` rewrites them
deliberately (see ``tests/golden.py``).

That run keeps the tiny random flavor ``diffpipe init`` writes (its golden values are of that model).
The last tests run ``config/demo.yaml`` itself on its shipped model (``config/demo_model``), in this
process, and check that its LoRA's samples move toward the training images (``tests/demo_learning.py``).
"""

from __future__ import annotations

import html
import math
import re
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
from diffpipe.data.dataset.demo import demo_item
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


def test_jobs_log_progress_and_status_reads_it(demo):
    """The train and cache jobs' logs hold progress lines (a log is no terminal: plain lines, the first and the
    last always), and their status files say finished (issue #41, live progress)."""
    p: RunPaths = demo["paths"]
    steps = len(read_metrics(p.metrics))
    train_log = (p.root / "logs" / "train.log").read_text()
    assert f"train: step 1/{steps} (" in train_log and f"train: step {steps}/{steps} (100%), loss " in train_log
    shard = p.shard_names("latents")[0]
    cache_log = (p.root / "logs" / "cache_latents" / f"{shard}.log").read_text()
    assert re.search(rf"^cache latents {shard}: (\d+)/\1 items \(100%\)", cache_log, re.MULTILINE), cache_log
    status = CliRunner().invoke(app, ["status", str(p.root)])
    assert status.exit_code == 0, status.output
    train = next(line for line in status.stderr.splitlines() if line.startswith("train "))
    assert "finished" in train and f"step {steps}/{steps} (100%)" in train


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
    outputs the rules mark report(): the run report, the sample images and the loss plot (#41)."""
    bundle = tmp_path / "snakemake-report.zip"
    done = run_workflow(demo["root"] / "config.yaml", cores=1, workdir=demo["root"], console=Console(stderr=True),
                        extra=["--report", str(bundle)])
    assert done.returncode == 0 and done.jobs == []
    names = zipfile.ZipFile(bundle).namelist()
    assert any("/data/" in n and n.endswith("/report.html") for n in names), names
    assert any(n.endswith("/grid.png") for n in names), names
    assert any(n.endswith("/loss.png") for n in names), names


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


def test_added_image_leaves_one_latent_shard_stale_whatever_the_spec_size(demo):
    """#43: the plan must keep an unchanged spec file as it was, mtime included. When Snakemake deleted
    the plan's folder before each plan job, every spec came back newer than its shard, and only
    Snakemake's input checksums (of files under ``--max-checksum-file-size``, 1 MB by default) kept the
    unchanged shards from rerunning: a shard of a few thousand items has a larger spec, and then any
    edit rebuilt every shard. A limit of 1 byte here stands for such specs."""
    root = demo["root"]
    image, caption = demo_item(100, size=64)  # an index past the demo's: new content
    image.save(root / "data" / "shape_100.png")
    (root / "data" / "shape_100.txt").write_text(caption + "\n")
    big_specs = ["--max-checksum-file-size", "1"]
    ran = run_workflow(root / "config.yaml", cores=2, extra=big_specs, workdir=root,
                       console=Console(stderr=True), targets=["plan"])
    assert ran.returncode == 0
    assert sorted(ran.jobs) == ["plan", "validate"]
    planned = [f"{j.rule}/{j.wildcards.removeprefix('shard=')}"
               for j in dry_run_jobs(root / "config.yaml", DEFAULT_PROFILE, root, extra=big_specs)]
    # New items all go to one shard; the caption edit before this test left one text shard stale too.
    assert len([j for j in planned if j.startswith("cache_latents/")]) == 1, planned
    assert len([j for j in planned if j.startswith("cache_text/")]) <= 2, planned


# -- the demo model learns: config/demo.yaml's shipped model, trained and sampled as `make demo` does ------
#: The demo's two prompts and four more, so the statistic averages over six samples a side.
LEARN_PROMPTS = ["a red circle on a blue background", "a yellow square on a black background",
                 "a green triangle on a white background", "a blue circle on a yellow background",
                 "a white square on a red background", "a black triangle on a green background"]


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """The demo config's own model (``config/demo_model``) and training settings, run in this process
    (validate, plan, caches, train); its LoRA sampled with :data:`LEARN_PROMPTS`, and again zeroed."""
    from stage_cli import rendezvous

    from diffpipe import stages
    from diffpipe.training.loop import train

    root = tmp_path_factory.mktemp("shipped")
    shutil.copytree(REPO_ROOT / "config" / "demo_data", root / "data")
    cfg = yaml.safe_load((REPO_ROOT / "config" / "demo.yaml").read_text())
    assert cfg["model"]["flavor"] == "local", "the demo runs the shipped model"
    cfg["model"]["path"] = str(REPO_ROOT / cfg["model"]["path"])
    cfg["datasets"][0]["path"] = str(root / "data")
    cfg["output_dir"] = str(root / "run")
    cfg["sample"]["prompts"] = LEARN_PROMPTS
    (root / "config.yaml").write_text(yaml.safe_dump(cfg))
    config, paths = load_config(root / "config.yaml"), RunPaths(root / "run")
    stages.prepare_data(config, paths)
    monkeypatch = rendezvous()
    try:
        train(config, paths, log=lambda *_: None)
    finally:
        monkeypatch.undo()
    return {"root": root, "cfg": config, "paths": paths}


def _grid_rows(grid_file, n: int, side: int):
    """The base row and the LoRA row of a sample grid, each image at its rendered size
    (``diffpipe.training.plots.caption_grid``'s layout: a label above each row, images scaled up by a whole
    factor to at least MIN_CELL pixels, GUTTER pixels apart; scaled back down by that factor here)."""
    from PIL import Image

    from diffpipe.training.plots import CAPTION_SIZE, GUTTER, MIN_CELL

    grid = Image.open(grid_file).convert("RGB")
    factor = max(1, math.ceil(MIN_CELL / side)) if side < MIN_CELL else 1
    cell, label_h = side * factor, CAPTION_SIZE + 4 + 6

    def row(r: int) -> list:
        top = r * (label_h + cell) + label_h
        return [grid.crop((x := GUTTER + i * (cell + GUTTER), top, x + cell, top + cell))
                .resize((side, side), Image.Resampling.NEAREST) for i in range(n)]

    return row(0), row(1)


def _samples(run, lora_dir, out):
    from PIL import Image

    from diffpipe.training.sample import render_samples

    render_samples(run["cfg"].model, run["cfg"].sample, lora_dir, out)
    base, lora = _grid_rows(out / "grid.png", len(LEARN_PROMPTS), run["cfg"].sample.width or 64)
    # The grid's LoRA row is the saved samples, pixel for pixel: the crops follow the grid's layout.
    saved = [Image.open(out / f"sample-{i:02d}.png").convert("RGB") for i in range(len(LEARN_PROMPTS))]
    assert [im.tobytes() for im in lora] == [im.tobytes() for im in saved]
    return base, lora


def _training_images():
    """The 16 demo images and their captions."""
    from PIL import Image

    pngs = sorted((REPO_ROOT / "config" / "demo_data").glob("*.png"))
    return [Image.open(p) for p in pngs], [p.with_suffix(".txt").read_text().strip() for p in pngs]


def test_demo_lora_moves_samples_toward_the_training_images(shipped):
    """The learning check: the base model draws small shapes, the 16 demo images hold large ones; the
    share of the LoRA's samples drawn in the prompt's shape colour must be closer to the images' than
    the base samples' share is, by MARGIN."""
    from demo_learning import MARGIN, learning_gain, mean_share

    base, lora = _samples(shipped, shipped["paths"].adapter_dir, shipped["root"] / "samples")
    train, captions = _training_images()
    gain = learning_gain(base, lora, LEARN_PROMPTS, train, captions)
    assert gain >= MARGIN, (f"shape-colour share: base {mean_share(base, LEARN_PROMPTS):.3f}, "
                            f"LoRA {mean_share(lora, LEARN_PROMPTS):.3f}, training images "
                            f"{mean_share(train, captions):.3f}; gain {gain:.3f} < {MARGIN}")


def test_learning_check_fails_with_the_lora_zeroed(shipped):
    """The same check on the same run with every lora_B set to zero (the LoRA does nothing) fails."""
    from demo_learning import MARGIN, learning_gain
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    zeroed = shipped["root"] / "zeroed-adapter"
    shutil.copytree(shipped["paths"].adapter_dir, zeroed)
    weights = zeroed / "adapter_model.safetensors"
    tensors = {k: torch.zeros_like(v) if ".lora_B." in k else v for k, v in load_file(weights).items()}
    with safe_open(weights, "pt") as f:
        metadata = f.metadata()
    save_file(tensors, weights, metadata=metadata)
    base, lora = _samples(shipped, zeroed, shipped["root"] / "zeroed-samples")
    assert [im.tobytes() for im in lora] == [im.tobytes() for im in base]
    assert learning_gain(base, lora, LEARN_PROMPTS, *_training_images()) < MARGIN
