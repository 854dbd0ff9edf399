"""Per-item loss masks and control images, from the dataset folders to the training loss.

One tiny-SD dataset of 32 px shapes with a parallel ``masks/`` and
``controls/`` folder (same stems) goes through the real validate, plan and
cache stages; then the cached arrays are checked against hand-made masks and
an independent VAE encoding of the control images, the masked loss against
its hand-computed value, and a 2-step DeepSpeed run against the masked loss
of its first batch.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from stage_cli import rendezvous
from typer.testing import CliRunner

from diffpipe.cache_jobs import cache_latents, cache_text
from diffpipe.cli import app
from diffpipe.config import CacheConfig, ModelConfig, ObjectiveConfig, ValidationConfig, parse_config
from diffpipe.data.cache.plan import make_plan
from diffpipe.data.cache.reader import CachedDataset
from diffpipe.data.dataset.demo import write_demo_dataset
from diffpipe.data.dataset.discover import dataset_files
from diffpipe.data.dataset.validate import run_validation
from diffpipe.families import get_family
from diffpipe.paths import RunPaths
from diffpipe.training.loop import DataOrder

MODEL = ModelConfig(family="sd")
SIZE = 32


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def left_half(size=SIZE) -> Image.Image:
    """A grayscale mask: left half white (trained), right half black."""
    arr = np.zeros((size, size), np.uint8)
    arr[:, : size // 2] = 255
    return Image.fromarray(arr, "L")


def top_half_alpha(size=SIZE) -> Image.Image:
    """An RGBA mask painted on a transparent layer: the top half opaque (black colour)."""
    arr = np.zeros((size, size, 4), np.uint8)
    arr[: size // 2, :, 3] = 255
    return Image.fromarray(arr, "RGBA")


def _tree_digest(*roots: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(f for root in roots for f in root.rglob("*")):
        if p.is_file():
            st = p.stat()
            h.update(f"{p}:{st.st_mtime_ns}:".encode() + p.read_bytes())
    return h.hexdigest()


class MaskRun:
    """``data/`` (6 shapes), ``masks/`` and ``controls/`` beside it, a run folder and the stages."""

    def __init__(self, root: Path):
        self.root = root
        self.data, self.masks, self.controls = root / "data", root / "masks", root / "controls"
        write_demo_dataset(self.data, n=6, size=SIZE)
        self.masks.mkdir()
        self.controls.mkdir()
        left_half().save(self.masks / "shape_000.png")
        top_half_alpha().save(self.masks / "shape_001.png")
        (self.masks / "shape_002.png").write_bytes(_png(left_half())[:60])  # truncated
        # shape_003: no mask (trains unmasked); shape_004: wrong aspect ratio
        left_half().resize((SIZE, SIZE // 2)).save(self.masks / "shape_004.png")
        left_half(2 * SIZE).save(self.masks / "shape_005.webp", lossless=True)  # double size, other ext
        for i in range(6):
            if i == 5:
                continue  # shape_005: no control (missing_control, skip)
            img = Image.open(self.data / f"shape_{i:03d}.png").convert("RGB")
            Image.fromarray(255 - np.asarray(img)).save(self.controls / f"shape_{i:03d}.png")
        self.paths = RunPaths(root / "run")
        self.family = get_family(MODEL)
        self.cache = CacheConfig(shards=1, batch_size=4, workers=0)

    def ds(self, **kw) -> dict:
        return {"name": "m", "path": str(self.data), "resolution": SIZE, "mask_path": str(self.masks),
                "control_path": str(self.controls), **kw}

    def config(self, **train) -> dict:
        train = {"max_steps": 2, "batch_size": 2, "lr": 0.01, "save_every_epochs": 0,
                 "eval": {"quantiles": []}, "lora": {"rank": 4, "alpha": 4}, **train}
        return {"output_dir": str(self.paths.root), "model": MODEL.model_dump(), "datasets": [self.ds()],
                "cache": self.cache.model_dump(), "train": train}

    def validate(self, vcfg: ValidationConfig | None = None, **kw):
        p = self.paths
        return run_validation([parse_config(self.config()).datasets[0].model_copy(update=kw)],
                              vcfg or ValidationConfig(), manifest_path=p.manifest,
                              report_json=p.report_json, report_html=p.report_html, workers=1)

    def plan_and_cache(self) -> list[dict]:
        cfg = parse_config(self.config())
        make_plan(self.paths.manifest, cfg.datasets, self.cache, latent_identity=self.family.vae_identity(),
                  text_identity=self.family.text_identity(), pixel_multiple=self.family.pixel_multiple,
                  paths=self.paths)
        out = []
        for s in self.paths.shard_names():
            out.append(cache_latents(self.paths.latent_spec(s), self.paths.latent_shard(s), MODEL, self.cache))
            cache_text(self.paths.text_spec(s), self.paths.text_shard(s), MODEL, self.cache)
        return out

    def rows(self) -> dict[str, dict]:
        import pyarrow.parquet as pq

        return {Path(r["path"]).stem: r for r in pq.read_table(self.paths.manifest).to_pylist()}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> MaskRun:
    r = MaskRun(tmp_path_factory.mktemp("masks"))
    before = _tree_digest(r.data, r.masks, r.controls)
    r.result = r.validate()
    r.summaries = r.plan_and_cache()
    r.untouched = before == _tree_digest(r.data, r.masks, r.controls)
    return r


def _by_stem(data: CachedDataset, stem: str, rows: dict[str, dict]) -> int:
    return next(i for i, it in enumerate(data.items) if it.id == rows[stem]["id"])


# -- validation ------------------------------------------------------------------------------
def test_aux_files_are_validated_like_targets(run):
    rows = run.rows()
    assert run.untouched, "validation or caching modified the dataset folders"
    expect = {
        "shape_000": ([], "ok"),
        "shape_001": ([], "ok"),
        "shape_002": (["corrupt_mask"], "skipped"),
        "shape_003": (["missing_mask"], "warning"),
        "shape_004": (["mask_size_mismatch"], "skipped"),
        "shape_005": (["missing_control"], "skipped"),
    }
    for stem, (reasons, status) in expect.items():
        assert (rows[stem]["reasons"], rows[stem]["status"]) == (reasons, status), stem
    notes = {stem: rows[stem]["notes"] for stem in expect}
    assert str(run.masks / "shape_002.png") in notes["shape_002"][0]
    assert str(run.masks / "shape_003") in notes["shape_003"][0]
    assert "32x16" in notes["shape_004"][0] and "same aspect ratio" in notes["shape_004"][0]
    assert str(run.controls / "shape_005") in notes["shape_005"][0]
    # The content hash of each aux file is in the manifest (and from there in the cache key).
    assert rows["shape_000"]["mask_sha256"] == hashlib.sha256((run.masks / "shape_000.png").read_bytes()).hexdigest()
    assert rows["shape_005"]["mask_path"] == str(run.masks / "shape_005.webp")
    assert rows["shape_001"]["control_sha256"] and rows["shape_003"]["mask_sha256"] is None
    report = json.loads(run.paths.report_json.read_text())
    assert report["counts"]["corrupt_mask"] == 1 and report["summary"]["errors"] == 0
    # Snakemake's validate inputs include the aux images, so editing one reruns validation.
    files = set(dataset_files(parse_config(run.config()).datasets[0], ValidationConfig()))
    assert run.masks / "shape_000.png" in files and run.controls / "shape_001.png" in files


def test_policy_turns_aux_problems_into_errors(run, tmp_path):
    other = MaskRun.__new__(MaskRun)
    other.__dict__.update(run.__dict__, paths=RunPaths(tmp_path / "run"))
    result = other.validate(ValidationConfig(actions={"corrupt_mask": "error", "missing_mask": "skip"}))
    errors = [i for i in result.issues if i.action == "error"]
    assert [(i.reason, Path(i.path).name) for i in errors] == [("corrupt_mask", "shape_002.png")]
    assert str(run.masks / "shape_002.png") in errors[0].message
    assert other.rows()["shape_003"]["status"] == "skipped"


def test_metadata_columns_and_aux_folder_inside_the_dataset(tmp_path):
    data = tmp_path / "data"
    write_demo_dataset(data / "images", n=3, size=SIZE)
    (data / "masks").mkdir()
    left_half().save(data / "masks" / "a.png")
    records = [{"file_name": "images/shape_000.png", "mask": "masks/a.png"},
               {"file_name": "images/shape_001.png", "mask": "masks/nope.png"},
               {"file_name": "images/shape_002.png", "mask": None}]
    for rec in records:
        rec["text"] = (data / rec["file_name"]).with_suffix(".txt").read_text()
        (data / rec["file_name"]).with_suffix(".txt").unlink()
    (data / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    paths = RunPaths(tmp_path / "run")
    cfg = parse_config({"datasets": [{"name": "x", "path": str(data), "mask_column": "mask", "resolution": SIZE}]})
    run_validation(cfg.datasets, ValidationConfig(), manifest_path=paths.manifest, report_json=paths.report_json,
                   report_html=paths.report_html, workers=1)
    import pyarrow.parquet as pq

    rows = {r["relpath"]: r for r in pq.read_table(paths.manifest).to_pylist()}
    assert sorted(rows) == ["images/shape_000.png", "images/shape_001.png", "images/shape_002.png"]  # no mask item
    assert rows["images/shape_000.png"]["mask_path"] == str(data / "masks" / "a.png")
    assert rows["images/shape_001.png"]["reasons"] == ["missing_mask"]
    assert str(data / "masks" / "nope.png") in rows["images/shape_001.png"]["notes"][0]
    assert "empty" in rows["images/shape_002.png"]["notes"][0]
    # A parallel folder inside the dataset folder is not listed as media either.
    (data / "images" / "masks").mkdir()
    left_half().save(data / "images" / "masks" / "shape_000.png")
    (data / "images" / "masks" / "shape_000.txt").write_text("not a caption")
    cfg = parse_config({"datasets": [{"name": "y", "path": str(data / "images"), "resolution": SIZE,
                                      "mask_path": str(data / "images" / "masks")}]})
    result = run_validation(cfg.datasets, ValidationConfig(), manifest_path=tmp_path / "m2.parquet",
                            report_json=tmp_path / "r2.json", report_html=tmp_path / "r2.html", workers=1)
    # Every item lacks its caption here, so the dataset has nothing to train on: an error (issue 14).
    assert result.items == 3 and result.counts == {"missing_caption": 3, "missing_mask": 2, "no_usable_items": 1}


# -- caching ---------------------------------------------------------------------------------
def test_cached_masks_at_latent_resolution(run):
    rows = run.rows()
    data = CachedDataset.from_run(run.paths)
    assert len(data) == 3  # shape_000, 001, 003 (002, 004, 005 skipped)
    batch = data.collate([_by_stem(data, s, rows) for s in ("shape_000", "shape_001", "shape_003")])
    lat, mask = batch["latents"], batch["mask"]
    h, w = lat.shape[-2:]
    assert mask.shape == (3, 1, 1, h, w) and h < SIZE
    expected = torch.zeros(h, w)
    expected[:, : w // 2] = 1
    torch.testing.assert_close(mask[0, 0, 0], expected)  # left half white
    torch.testing.assert_close(mask[1, 0, 0], expected.T)  # alpha mask: top half opaque
    torch.testing.assert_close(mask[2], torch.ones(1, 1, h, w))  # no mask: trains unmasked
    # One item unmasked in a batch of unmasked items: no mask at all.
    assert data.collate([_by_stem(data, "shape_003", rows)] * 2)["mask"] is None


def test_double_size_mask_lines_up(run, tmp_path):
    other = MaskRun.__new__(MaskRun)
    other.__dict__.update(run.__dict__, paths=RunPaths(tmp_path / "run"))
    other.validate(ValidationConfig(actions={"missing_control": "warn"}))
    other.plan_and_cache()
    rows = other.rows()
    data = CachedDataset.from_run(other.paths)
    batch = data.collate([_by_stem(data, "shape_005", rows)])
    h, w = batch["latents"].shape[-2:]
    expected = torch.zeros(h, w)
    expected[:, : w // 2] = 1
    # Downscaled with the target's resampling, then area-averaged: within a few percent at the edge.
    torch.testing.assert_close(batch["mask"][0, 0, 0], expected, atol=0.06, rtol=0)
    assert batch["control_latents"] is None and batch["control_missing"] == [rows["shape_005"]["id"]]


def test_control_latents_are_the_vae_encoding_of_the_cropped_control(run):
    rows = run.rows()
    data = CachedDataset.from_run(run.paths)
    stems = ["shape_000", "shape_001"]
    batch = data.collate([_by_stem(data, s, rows) for s in stems])
    # Independent of the cache's loader: the images are bucket-sized, so the crop is the identity.
    pixels = torch.stack([
        torch.from_numpy(np.asarray(Image.open(run.controls / f"{s}.png").convert("RGB"), np.float32))
        .permute(2, 0, 1)[:, None] / 127.5 - 1 for s in stems
    ])
    with torch.no_grad():
        expected = run.family.encode_pixels(run.family.load_vae(), pixels)
    assert batch["control_latents"].shape == batch["latents"].shape
    torch.testing.assert_close(batch["control_latents"], expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(batch["control_latents"], batch["latents"])


def test_editing_a_mask_recaches_only_that_item(run, tmp_path):
    shutil.copytree(run.root, tmp_path / "copy", ignore=shutil.ignore_patterns("run"))
    other = MaskRun.__new__(MaskRun)
    store = run.paths.root / "cache" / "store"
    other.__dict__.update(run.__dict__, root=tmp_path / "copy", data=tmp_path / "copy" / "data",
                          masks=tmp_path / "copy" / "masks", controls=tmp_path / "copy" / "controls",
                          paths=RunPaths(tmp_path / "copy" / "run"),
                          cache=run.cache.model_copy(update={"dir": str(store)}))
    assert other.validate().hashed == 6 + 5 + 5  # a new manifest: every media, mask, control read once
    first = other.plan_and_cache()
    assert sum(s["encoded"] for s in first) == 0  # every entry came from the shared store
    top_half_alpha().save(other.masks / "shape_000.png")  # edit one mask
    result = other.validate()
    assert result.hashed == 1  # only the edited mask is read again
    summary = other.plan_and_cache()
    assert sum(s["encoded"] for s in summary) == 1 and sum(s["reused"] for s in summary) == 2
    rows = other.rows()
    data = CachedDataset.from_run(other.paths)
    mask = data.collate([_by_stem(data, "shape_000", rows)])["mask"][0, 0, 0]
    h, w = mask.shape
    assert mask[: h // 2].min() == 1 and mask[h // 2 :].max() == 0  # the new mask


# -- loss ------------------------------------------------------------------------------------
def _loss_parts(family, batch, t, noise):
    """The denoiser's prediction and the epsilon target at fixed t and noise (by hand)."""
    out = []
    denoiser = family.load_denoiser()
    handle = denoiser.register_forward_hook(lambda m, a, o: out.append(o[0] if isinstance(o, tuple) else o.sample))
    with torch.no_grad():
        plain = family.loss(denoiser, batch["latents"], batch["text"], torch.Generator(), t=t, noise=noise)
    handle.remove()
    return denoiser, out[0], noise[:, :, 0], plain


def test_masked_loss_is_the_hand_computed_weighted_mean(run):
    rows = run.rows()
    data = CachedDataset.from_run(run.paths)
    batch = data.collate([_by_stem(data, s, rows) for s in ("shape_000", "shape_001", "shape_003")])
    family = run.family
    t = torch.tensor([0.2, 0.5, 0.8])
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(1))
    denoiser, pred, target, plain = _loss_parts(family, batch, t, noise)
    err = (pred - target).pow(2)  # [B, C, h, w]
    m = batch["mask"][:, :, 0].expand_as(err)
    for floor in (0.0, 0.25):
        w = floor + (1 - floor) * m
        expected = (w * err).sum(dim=(1, 2, 3)) / w.sum(dim=(1, 2, 3))
        with torch.no_grad():
            got = family.loss(denoiser, batch["latents"], batch["text"], torch.Generator(), t=t, noise=noise,
                              objective=ObjectiveConfig(mask_min_weight=floor), mask=batch["mask"])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(got[:2], plain[:2])  # the masked items' losses change
    torch.testing.assert_close(got[2], plain[2])  # the unmasked item's does not
    with torch.no_grad():
        ones = family.loss(denoiser, batch["latents"], batch["text"], torch.Generator(), t=t, noise=noise,
                           mask=torch.ones_like(batch["mask"]))
        # Min-SNR weighting still applies on top of the mask: weight x masked mean.
        o = ObjectiveConfig(min_snr_gamma=1.0)
        snr_masked = family.loss(denoiser, batch["latents"], batch["text"], torch.Generator(), t=t,
                                 noise=noise, objective=o, mask=batch["mask"])
    torch.testing.assert_close(ones, plain, rtol=1e-6, atol=0)  # all-ones mask = unmasked
    from diffpipe.models import objectives as obj

    schedule = family.noise_scheduler().alphas_cumprod
    snr_w = obj.min_snr_weights(schedule, obj.ddpm_timesteps(t, len(schedule)), gamma=1.0)
    w = m
    torch.testing.assert_close(snr_masked, snr_w * (w * err).sum(dim=(1, 2, 3)) / w.sum(dim=(1, 2, 3)),
                               rtol=1e-5, atol=1e-7)


# -- training --------------------------------------------------------------------------------
def test_two_deepspeed_steps_train_on_the_masked_loss(run, tmp_path, monkeypatch):
    shutil.copytree(run.paths.root, tmp_path / "run", ignore=shutil.ignore_patterns("train"))
    other = MaskRun.__new__(MaskRun)
    other.__dict__.update(run.__dict__, paths=RunPaths(tmp_path / "run"))
    cfg = other.config(objective={"mask_min_weight": 0.1})
    config = tmp_path / "masked.yaml"
    config.write_text(yaml.safe_dump(cfg))
    rendezvous(monkeypatch)
    result = CliRunner().invoke(app, ["train", "-c", str(config)])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    assert "control latents are not used" in result.output  # sd ignores them, and says so
    metrics = [json.loads(x) for x in other.paths.metrics.read_text().splitlines()]
    assert len(metrics) == 2 and all(np.isfinite(m["loss"]) for m in metrics)

    # The LoRA starts as a no-op, so step 1's loss is the base model's masked loss on the first batch.
    c = parse_config(cfg)
    data = CachedDataset.from_run(other.paths)
    idx = DataOrder(data, c.train, 0, 1).micro_batches(0)[0]
    batch = data.collate(idx)
    gen = torch.Generator().manual_seed(c.train.seed * 1000)
    family = run.family
    denoiser = family.load_denoiser()
    with torch.no_grad():
        masked = family.loss(denoiser, batch["latents"], batch["text"], gen, objective=c.train.objective,
                             mask=batch["mask"]).mean()
        unmasked = family.loss(denoiser, batch["latents"], batch["text"],
                               torch.Generator().manual_seed(c.train.seed * 1000), objective=c.train.objective).mean()
    assert batch["mask"] is not None and not torch.allclose(masked, unmasked)
    assert metrics[0]["loss"] == pytest.approx(float(masked), rel=1e-5)
