"""Table datasets: a folder saved by the ``datasets`` library, Parquet shards, a hub id.

The datasets are written offline by the real ``datasets`` library and pyarrow;
the hub id resolves through a Hugging Face cache folder laid out as the hub
client lays it out (``datasets--org--name/{blobs,refs,snapshots}``), read by the
real ``huggingface_hub`` in offline mode. One ``diffpipe run`` goes from the hub
id to a trained LoRA; the rest calls the stages directly.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image
from stage_cli import starter_in_process
from typer.testing import CliRunner

from diffpipe.cache_decode import decode_item
from diffpipe.cache_jobs import cache_latents, cache_text
from diffpipe.cli import app
from diffpipe.config import CacheConfig, DatasetConfig, ModelConfig, ValidationConfig
from diffpipe.data.cache.plan import make_plan
from diffpipe.data.dataset.media import probe
from diffpipe.data.dataset.tables import TableError, find_tables, parse_locator
from diffpipe.data.dataset.validate import run_validation
from diffpipe.families import get_family
from diffpipe.paths import RunPaths

datasets = pytest.importorskip("datasets")  # the dev extra installs it; never counted as a pass

MODEL = ModelConfig(family="sd")
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _png(i: int, size: int = 32) -> bytes:
    rng = np.random.default_rng(i)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _bomb_png(side: int = 100_000) -> bytes:
    """A valid PNG signature and IHDR declaring side x side pixels (and nothing to decode)."""
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk + struct.pack(">I", zlib.crc32(chunk))


def _save(folder: Path, images: list[bytes | None], captions: list[str | None]) -> None:
    """``save_to_disk`` of an image + text dataset (replacing an earlier save, as a user would)."""
    feats = datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")})
    cells = [None if b is None else {"bytes": b, "path": f"img{i}.png"} for i, b in enumerate(images)]
    ds = datasets.Dataset.from_dict({"image": cells, "text": captions}, features=feats)
    if folder.exists():
        shutil.rmtree(folder)
    ds.save_to_disk(str(folder))


def _parquet(path: Path, images: list[bytes | None], captions: list[str | None]) -> None:
    """A hub-style Parquet shard: ``image`` as the ``{bytes, path}`` struct, ``text`` captions."""
    path.parent.mkdir(parents=True, exist_ok=True)
    image = pa.array([None if b is None else {"bytes": b, "path": f"{i}.png"} for i, b in enumerate(images)],
                     pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    pq.write_table(pa.table({"image": image, "text": pa.array(captions, pa.string())}), path, row_group_size=3)


def _hub_cache(cache: Path, repo: str, files: dict[str, bytes]) -> Path:
    """The hub client's cache layout for dataset ``repo`` at one commit; returns the snapshot."""
    top = cache / f"datasets--{repo.replace('/', '--')}"
    snap = top / "snapshots" / COMMIT
    for rel, data in files.items():
        blob = top / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (top / "refs").mkdir(parents=True, exist_ok=True)
    (top / "refs" / "main").write_text(COMMIT)
    return snap


class Stages:
    """validate -> plan -> the cache jobs whose spec changed, as Snakemake would run them."""

    def __init__(self, root: Path, family, **ds):
        self.paths, self.family, self.ds = RunPaths(root / "run"), family, {"name": "t", "resolution": 32, **ds}
        self.cache = CacheConfig(shards=2, batch_size=4, workers=0)
        self.specs: dict[Path, bytes] = {}

    def validate(self):
        p = self.paths
        return run_validation([DatasetConfig(**self.ds)], ValidationConfig(), manifest_path=p.manifest,
                              report_json=p.report_json, report_html=p.report_html, workers=1)

    def manifest(self) -> list[dict]:
        return pq.read_table(self.paths.manifest).to_pylist()

    def plan_and_cache(self, *, force: bool = False) -> dict[str, list[dict]]:
        make_plan(self.paths.manifest, [DatasetConfig(**self.ds)], self.cache, paths=self.paths,
                  latent_identity=self.family.vae_identity(), text_identity=self.family.text_identity(),
                  pixel_multiple=self.family.pixel_multiple)
        out: dict[str, list[dict]] = {"latents": [], "text": []}
        p = self.paths
        for s in p.shard_names():
            for kind, spec, target, fn in (("latents", p.latent_spec(s), p.latent_shard(s), cache_latents),
                                           ("text", p.text_spec(s), p.text_shard(s), cache_text)):
                data = spec.read_bytes()
                if force or self.specs.get(spec) != data:
                    if target.is_dir():
                        shutil.rmtree(target)
                    out[kind].append(fn(spec, target, MODEL, self.cache))
                    self.specs[spec] = data
        return out


def _total(summaries: list[dict], key: str) -> int:
    return sum(s[key] for s in summaries)


@pytest.fixture(scope="module")
def family():
    return get_family(MODEL)


def test_saved_dataset_caption_edit_reencodes_one_text_and_reordering_nothing(tmp_path, family):
    images = [_png(i) for i in range(6)]
    captions = [f"a noisy picture number {i}" for i in range(6)]
    _save(tmp_path / "saved", images, captions)
    run = Stages(tmp_path, family, path=str(tmp_path / "saved"))
    first = run.validate()
    assert (first.items, first.kept, first.hashed, first.errors) == (6, 6, 6, 0)
    rows = run.manifest()
    assert {parse_locator(r["path"]).fmt for r in rows} == {"arrow"}
    assert sorted(r["relpath"] for r in rows) == [f"train/{i}" for i in range(6)]
    assert {r["sha256"] for r in rows} == {hashlib.sha256(b).hexdigest() for b in images}
    jobs = run.plan_and_cache()
    assert _total(jobs["latents"], "encoded") == 6 and _total(jobs["text"], "encoded") == 6

    captions[2] = "a noisy picture with an edited caption"
    _save(tmp_path / "saved", images, captions)
    second = run.validate()
    assert second.hashed == 0 and second.reused == 6  # content unchanged: nothing decoded again
    assert {r["id"] for r in run.manifest()} == {r["id"] for r in rows}
    jobs = run.plan_and_cache()
    assert jobs["latents"] == []  # no latent spec changed
    assert len(jobs["text"]) == 1 and jobs["text"][0]["encoded"] == 1

    # Rows reordered: the same items (ids follow the bytes), their shards and cache entries kept.
    order = [5, 3, 1, 0, 2, 4]
    _save(tmp_path / "saved", [images[i] for i in order], [captions[i] for i in order])
    third = run.validate()
    assert third.hashed == 0 and {r["id"] for r in run.manifest()} == {r["id"] for r in rows}
    jobs = run.plan_and_cache(force=True)
    assert _total(jobs["latents"], "encoded") == 0 and _total(jobs["text"], "encoded") == 0
    assert _total(jobs["latents"], "reused") == 6


def test_parquet_shards_flag_bad_rows_like_bad_files(tmp_path):
    good = [_png(i) for i in range(4)]
    # Shard 0: good, corrupt bytes, good; shard 1: bomb header, empty bytes, no cell, good, good.
    _parquet(tmp_path / "pq/data/train-00000-of-00002.parquet", [good[0], good[1][:60], good[2]], ["a", "b", "c"])
    _parquet(tmp_path / "pq/data/train-00001-of-00002.parquet", [_bomb_png(), b"", None, good[3], _png(9)],
             ["d", "e", "f", "g", None])
    _parquet(tmp_path / "pq/data/test-00000-of-00001.parquet", [_png(20)], ["other split"])
    p = RunPaths(tmp_path / "run")
    result = run_validation([DatasetConfig(name="p", path=str(tmp_path / "pq"), resolution=32)], ValidationConfig(),
                            manifest_path=p.manifest, report_json=p.report_json, report_html=p.report_html,
                            workers=1)
    assert result.items == 8  # the test split is not read
    found = {(Path(parse_locator(i.path).file).name, parse_locator(i.path).row): i.reason for i in result.issues}
    assert found == {
        ("train-00000-of-00002.parquet", 1): "corrupt_media",
        ("train-00001-of-00002.parquet", 0): "decompression_bomb",
        ("train-00001-of-00002.parquet", 1): "zero_byte",
        ("train-00001-of-00002.parquet", 2): "missing_file",
        ("train-00001-of-00002.parquet", 4): "missing_caption",
    }
    by_reason = {i.reason: i for i in result.issues}
    assert "100000x100000" in by_reason["decompression_bomb"].message
    assert "row 4 of train-00001-of-00002.parquet" in by_reason["missing_caption"].message
    report = json.loads(p.report_json.read_text())
    assert "#row=1&column=image" in json.dumps(report)  # the report names the row
    assert result.kept == 3 and result.errors == 0

    # The same bytes in a file give the same verdict: one probe, one set of reason codes.
    def codes(path):
        return [code for code, _ in probe(path, "image", 10**8).problems]

    for shard, row, data in (("train-00000-of-00002", 1, good[1][:60]), ("train-00001-of-00002", 0, _bomb_png())):
        f = tmp_path / f"{shard}-{row}.png"
        f.write_bytes(data)
        assert codes(f"parquet:{tmp_path}/pq/data/{shard}.parquet#row={row}&column=image") == codes(str(f)) != []


def test_cache_decoder_reads_a_cell_like_its_file(tmp_path):
    data = _png(3, size=40)
    _parquet(tmp_path / "pq/train.parquet", [_png(1), data], ["x", "y"])
    (tmp_path / "same.png").write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    item = {"bucket": [1, 32, 32], "sha256": sha}
    loc = f"parquet:{tmp_path}/pq/train.parquet#row=1&column=image"
    from_cell = decode_item(({**item, "path": loc}, False))["pixels"]
    from_file = decode_item(({**item, "path": str(tmp_path / "same.png")}, False))["pixels"]
    assert np.array_equal(from_cell, from_file)
    with pytest.raises(ValueError, match="changed since validation"):
        decode_item(({**item, "path": loc, "sha256": "0" * 64}, False))
    # A cell whose header declares too many pixels is refused before decoding, even when trusted.
    _parquet(tmp_path / "pq/train.parquet", [_png(1), _bomb_png()], ["x", "y"])
    with pytest.raises(ValueError, match=r"100000x100000 = .* pixels, over validation.max_pixels"):
        decode_item(({**item, "path": loc}, True))


def test_layouts_and_splits(tmp_path):
    feats = datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")})
    split = datasets.Dataset.from_dict({"image": [{"bytes": _png(0), "path": None}], "text": ["a"]}, features=feats)
    datasets.DatasetDict({"train": split, "validation": split}).save_to_disk(str(tmp_path / "dd"))
    tables = find_tables(tmp_path / "dd", "validation", parquet=False)
    assert tables.fmt == "arrow" and all("/validation/" in f for f in tables.files)
    with pytest.raises(TableError, match=r"splits \['train', 'validation'\], not 'test'"):
        find_tables(tmp_path / "dd", "test", parquet=False)
    _parquet(tmp_path / "hub/default/train/0000.parquet", [_png(1)], ["a"])
    assert find_tables(tmp_path / "hub", "train", parquet=True).files[0].endswith("default/train/0000.parquet")
    assert find_tables(tmp_path / "hub", "train", parquet=False) is None


def test_hub_id_offline_runs_the_workflow(tmp_path):
    buf = io.BytesIO()
    images = [_png(i) for i in range(4)]
    image = pa.array([{"bytes": b, "path": f"{i}.png"} for i, b in enumerate(images)],
                     pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    pq.write_table(pa.table({"image": image, "caption": [f"noise {i}" for i in range(4)]}), buf)
    snap = _hub_cache(tmp_path / "hf", "some-org/tiny-set",
                      {"data/train-00000-of-00001.parquet": buf.getvalue(), "README.md": b"# tiny\n"})
    cfg = {"output_dir": "run", "model": {"family": "sd", "flavor": "tiny"},
           "datasets": [{"name": "hubset", "hub": "some-org/tiny-set", "resolution": 32}],
           "cache": {"shards": 1}, "train": {"max_steps": 2, "batch_size": 2, "save_every_epochs": 0},
           "sample": {"prompts": ["noise"], "steps": 10}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    env = {"HF_HUB_CACHE": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    # Up to training (export and sampling do not read the dataset): the slow part is start-up per job.
    args = ["run", "--config", str(tmp_path / "config.yaml"), "--workdir", str(tmp_path), "--cores", "2",
            "--target", "train"]
    done = starter_in_process(*args, env=env)  # Snakemake and its jobs are processes, as from a shell
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    paths = RunPaths(tmp_path / "run")
    rows = pq.read_table(paths.manifest).to_pylist()
    assert {parse_locator(r["path"]).file for r in rows} == {f"{snap}/data/train-00000-of-00001.parquet"}
    assert sorted(r["caption"] for r in rows) == [f"noise {i}" for i in range(4)]
    assert len(paths.metrics.read_text().splitlines()) == 2
    again = starter_in_process(*args, env=env)
    assert again.returncode == 0 and "0 Snakemake jobs ran" in again.stdout + again.stderr


def test_absent_hub_id_offline_is_a_clear_error(tmp_path, monkeypatch):
    cache = tmp_path / "empty-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = {"output_dir": str(tmp_path / "run"), "datasets": [{"name": "h", "hub": "some-org/absent"}]}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(app, ["validate", "-c", str(tmp_path / "c.yaml")])
    assert result.exit_code == 1, result.output
    flat = " ".join(result.output.split())
    assert "missing_dataset" in flat and "'some-org/absent'" in flat and str(cache) in flat.replace(" ", "")
    assert "HF_HUB_OFFLINE" in flat and "Traceback" not in result.output
    # `diffpipe run` stops while Snakemake builds its DAG, as for a dataset folder that does not exist.
    from diffpipe.config import load_config
    from diffpipe.workflow import dataset_fingerprint

    with pytest.raises(FileNotFoundError, match=r"dataset 'some-org/absent' is not in the Hugging Face cache"):
        dataset_fingerprint(load_config(tmp_path / "c.yaml"))


def test_video_column_rows_are_probed_and_decoded_from_memory(tmp_path):
    from diffpipe.data.dataset.demo_video import demo_clip, write_clip

    clips = []
    for i in range(2):
        frames, _ = demo_clip(i)
        clips.append(write_clip(frames, tmp_path / f"c{i}.mp4", fps=16).read_bytes())
    table = pa.table({"video": pa.array(clips, pa.binary()), "prompt": ["a clip", "another clip"]})
    (tmp_path / "v").mkdir()
    pq.write_table(table, tmp_path / "v" / "train-00000-of-00001.parquet")
    p = RunPaths(tmp_path / "run")
    result = run_validation([DatasetConfig(name="v", path=str(tmp_path / "v"), video_column="video", resolution=32)],
                            ValidationConfig(), manifest_path=p.manifest, report_json=p.report_json,
                            report_html=p.report_html, workers=1)
    assert (result.items, result.kept, result.errors) == (2, 2, 0)
    rows = sorted(pq.read_table(p.manifest).to_pylist(), key=lambda r: r["relpath"])
    assert [(r["kind"], r["frames"], r["caption"]) for r in rows] == [("video", 9, "a clip"), ("video", 9, "another clip")]
    item = {"path": rows[0]["path"], "sha256": rows[0]["sha256"], "bucket": [5, 32, 48], "frames": [0, 1, 2, 3, 4]}
    from_cell = decode_item((item, False))["pixels"]
    from_file = decode_item(({**item, "path": str(tmp_path / "c0.mp4")}, False))["pixels"]
    assert from_cell.shape == (3, 5, 32, 48) and np.array_equal(from_cell, from_file)


@pytest.mark.parametrize("file", ["/data/a#row=1&column=x/train.parquet", "/data/with space/d.arrow"])
@pytest.mark.parametrize("column", ["image", "a&b#c=d", "bild ü"])
def test_locator_round_trip(file, column):
    from diffpipe.data.dataset.tables import Cell, locator

    cell = Cell("arrow" if file.endswith(".arrow") else "parquet", file, 7, column)
    assert parse_locator(locator(cell)) == cell
    assert parse_locator(file) is None and parse_locator("/data/parquet:x.png") is None


def test_hub_snapshot_of_files_reads_as_a_folder(tmp_path, monkeypatch):
    """A hub repo of image files with a ``metadata.jsonl`` (imagefolder): its links lead into ``blobs/``."""
    rows = [{"file_name": f"train/{i}.png", "text": f"picture {i}"} for i in range(3)]
    files = {f"train/{i}.png": _png(i) for i in range(3)}
    files["train/metadata.jsonl"] = "".join(json.dumps({**r, "file_name": f"{i}.png"}) + "\n"
                                            for i, r in enumerate(rows)).encode()
    _hub_cache(tmp_path / "hf", "org/files", files)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    p = RunPaths(tmp_path / "run")
    result = run_validation([DatasetConfig(name="f", hub="org/files", revision=COMMIT, resolution=32)], ValidationConfig(),
                            manifest_path=p.manifest, report_json=p.report_json, report_html=p.report_html,
                            workers=1)
    assert (result.items, result.kept, result.errors) == (3, 3, 0), result.issues
    assert sorted(r["caption"] for r in pq.read_table(p.manifest).to_pylist()) == [r["text"] for r in rows]


def test_sharded_table_validation_equals_one_job_without_reading_media(tmp_path, monkeypatch):
    """Parquet files split over 3 validation shards: each shard job hashes and probes its files' rows, the
    merging job reads only the captions and gives the manifest and reports of one job (repeats of the same
    bytes across files numbered in the same order); an edited file reruns only its shard, which probes only
    the content it had not seen."""
    from diffpipe.data.dataset import table_items
    from diffpipe.data.dataset import tables as tables_mod
    from diffpipe.data.dataset.discover import vshard_names, vshard_of
    from diffpipe.data.dataset.vshards import run_shard

    good = [_png(i) for i in range(6)]
    files = {f"data/train-0000{k}-of-00004.parquet": rows for k, rows in enumerate(
        [[good[0], good[1][:60], good[2]], [good[0], _bomb_png(), None], [good[3], good[0]], [good[4], b""]])}
    for rel, images in files.items():
        _parquet(tmp_path / "pq" / rel, images, [f"{rel} {i}" for i in range(len(images))])
    ds = DatasetConfig(name="p", path=str(tmp_path / "pq"), resolution=32)
    vcfg = ValidationConfig(shards=3)

    def validate(out: Path, probes=()):
        p = RunPaths(out)
        result = run_validation([ds], vcfg, manifest_path=p.manifest, report_json=p.report_json,
                                report_html=p.report_html, workers=1, probes=tuple(probes))
        return result, p

    single, one = validate(tmp_path / "one")
    probes = [tmp_path / "probe" / f"{n}.parquet" for n in vshard_names(3)]
    shards = [run_shard([ds], vcfg, shard=n, shards=3, out_path=path, workers=1)
              for n, path in zip(vshard_names(3), probes, strict=True)]
    assert sum(s.table_rows for s in shards) == 10 and sum(s.files for s in shards) == 4
    read, counters = [], []
    real, repeats = tables_mod.iter_rows, table_items.Repeats
    monkeypatch.setattr("diffpipe.data.dataset.table_items.iter_rows",
                        lambda t, cols: read.append(cols) or real(t, cols))
    monkeypatch.setattr(table_items, "Repeats", lambda only: counters.append(r := repeats(only)) or r)
    merged, many = validate(tmp_path / "many", probes)
    assert read and all(cols == ["text"] for cols in read)  # no media column read by the merge
    # Repeats are counted only for the content found more than once in the shards' columns (good[0], 3 copies).
    assert [dict(c.counts) for c in counters] == [{hashlib.sha256(good[0]).hexdigest(): 3}]
    assert (merged.items, merged.kept, merged.counts) == (single.items, single.kept, single.counts)
    assert pq.read_table(one.manifest).equals(pq.read_table(many.manifest))
    for a, b in ((one.report_json, many.report_json), (one.report_html, many.report_html)):
        assert a.read_text() == b.read_text().replace(str(many.root), str(one.root))
    monkeypatch.undo()

    # One file edited: its shard alone reruns, and probes only the new content (good[5]).
    _parquet(tmp_path / "pq/data/train-00003-of-00004.parquet", [good[4], good[5]], ["x", "y"])
    again = [run_shard([ds], vcfg, shard=n, shards=3, out_path=path, workers=1)
             for n, path in zip(vshard_names(3), probes, strict=True)]
    home = vshard_of("p", "data/train-00003-of-00004.parquet", 3)
    assert [s.changed for s in again] == [i == home for i in range(3)]
    assert again[home].table_rows_probed == 1
    single, one = validate(tmp_path / "one")
    merged, many = validate(tmp_path / "many", probes)
    assert pq.read_table(one.manifest).equals(pq.read_table(many.manifest))
