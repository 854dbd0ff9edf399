"""The validate stage on a dataset holding every problem it must find, next to good files."""

import hashlib
import io
import json
import os
import struct
from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from diffpipe.config import DatasetConfig, ModelConfig, ValidationConfig
from diffpipe.data.dataset.demo import write_demo_dataset
from diffpipe.data.dataset.discover import dataset_files
from diffpipe.data.dataset.media import probe
from diffpipe.data.dataset.validate import item_id, run_validation
from diffpipe.families.token_counter import FamilyTokenCounter
from diffpipe.policy import REASONS

VCFG = ValidationConfig(min_size=16, min_frames=2, max_pixels=50_000)
ROOT_USER = os.geteuid() == 0

# media file -> expected reason codes (empty: kept as is)
EXPECTED = {
    "shape_000.png": [],
    "shape_001.png": [],
    "shape_002.png": [],
    "sub/deeper/nested.png": [],
    "UPPER.PNG": [],
    "rotated.jpg": [],
    "multi.png": [],
    "cmyk.jpg": [],
    "gray16.png": [],
    "palette.png": [],
    "rgba.webp": [],
    "clip.mp4": [],
    "anim.gif": [],
    "no_caption.png": ["missing_caption"],
    "empty_caption.png": ["empty_caption"],
    "blank_caption.png": ["empty_caption"],
    "latin1.png": ["caption_not_utf8"],
    "long_caption.png": ["caption_too_long"],
    "truncated.png": ["corrupt_media"],
    "garbage.jpg": ["corrupt_media"],
    "zero.png": ["zero_byte"],
    "mismatch.png": ["extension_mismatch"],
    "tiny.png": ["too_small"],
    "small.png": ["too_small"],
    "wide.png": ["bad_aspect"],
    "bomb.png": ["decompression_bomb"],
    "short.webm": ["too_few_frames"],
    "noframes.mp4": ["no_frames"],
    "badvideo.mkv": ["corrupt_media"],
    "zz_dup.png": ["duplicate_media"],
    "zz_dupcap.png": ["duplicate_caption"],
}
if not ROOT_USER:
    EXPECTED["locked.png"] = ["unreadable"]
WARN_ONLY = {"caption_too_long", "extension_mismatch", "duplicate_media", "duplicate_caption"}

# Problems that are not rows: (path relative to the dataset, reason)
NOT_ROWS = {
    ("orphan.txt", "orphan_caption"),
    ("broken.png", "broken_symlink"),
    ("selfloop.png", "symlink_loop"),
    ("loop", "symlink_loop"),
    ("bad\\xff.png", "bad_filename"),
}


def _clip(path: Path, n: int, fmt: str, codec: str, fps: int = 8) -> None:
    with av.open(str(path), "w", format=fmt) as c:
        s = c.add_stream(codec, rate=fps)
        s.width = s.height = 32
        s.pix_fmt = "yuv420p"
        for i in range(n):
            frame = av.VideoFrame.from_ndarray(
                np.full((32, 32, 3), i * 20, np.uint8), format="rgb24"
            )
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def _make_dataset(root: Path) -> Path:
    write_demo_dataset(root, n=3, size=32)
    good = (root / "shape_000.png").read_bytes()

    def img(rel, size=(32, 32), caption="a caption for {}", mode="RGB", color=None, **save):
        path = root / rel
        if color is None:  # distinct pixels per file: equal content is its own test
            color = tuple(hashlib.sha256(rel.encode()).digest()[: len(mode)])
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new(mode, size, color).save(path, **save)
        if caption is not None:
            path.with_suffix(".txt").write_text(caption.format(rel))

    img("sub/deeper/nested.png")
    img("UPPER.PNG")
    exif = Image.Exif()
    exif[0x0112] = 6  # stored 40x20, shown 20x40
    img("rotated.jpg", size=(40, 20), exif=exif.tobytes())
    img("multi.png", caption="first caption\n\n  second   caption \n")
    img("cmyk.jpg", mode="CMYK", color=(0, 50, 100, 0))
    Image.fromarray(np.full((32, 32), 40000, np.uint16)).save(root / "gray16.png")
    (root / "gray16.txt").write_text("sixteen bit")
    pal = Image.new("P", (32, 32), 1)
    pal.putpalette([0, 0, 0, 255, 0, 0] * 128)
    pal.save(root / "palette.png", transparency=0)
    (root / "palette.txt").write_text("palette")
    img("rgba.webp", mode="RGBA", color=(1, 2, 3, 100))
    _clip(root / "clip.mp4", 8, "mp4", "mpeg4")
    (root / "clip.txt").write_text("a video")
    frames = [Image.new("RGB", (32, 32), (i * 80, 0, 0)) for i in range(3)]
    frames[0].save(root / "anim.gif", save_all=True, append_images=frames[1:], duration=100)
    (root / "anim.txt").write_text("a gif")

    img("no_caption.png", caption=None)
    img("empty_caption.png", caption="")
    img("blank_caption.png", caption=" \n\t ")
    img("latin1.png", caption=None)
    (root / "latin1.txt").write_bytes("café au lait".encode("latin-1"))
    img("long_caption.png", caption=" ".join(["word"] * 120))
    (root / "truncated.png").write_bytes(good[: len(good) // 2])
    (root / "truncated.txt").write_text("cut")
    (root / "garbage.jpg").write_bytes(b"\xff\xd8 definitely not a jpeg" * 10)
    (root / "garbage.txt").write_text("junk")
    (root / "zero.png").write_bytes(b"")
    (root / "zero.txt").write_text("nothing")
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (1, 1, 1)).save(buf, format="JPEG")
    (root / "mismatch.png").write_bytes(buf.getvalue())
    (root / "mismatch.txt").write_text("a jpeg in disguise")
    img("tiny.png", size=(8, 20))
    img("small.png", size=(20, 20))
    img("wide.png", size=(200, 20))
    img("bomb.png", size=(300, 300))
    _clip(root / "short.webm", 1, "webm", "libvpx")
    (root / "short.txt").write_text("one frame")
    _clip(root / "noframes.mp4", 4, "mp4", "mpeg4")
    data = bytearray((root / "noframes.mp4").read_bytes())
    at = data.find(b"mdat")
    size = struct.unpack(">I", data[at - 4 : at])[0]
    data[at + 4 : at - 4 + size] = bytes(size - 8)  # the frames' bytes, container intact
    (root / "noframes.mp4").write_bytes(bytes(data))
    (root / "noframes.txt").write_text("zeros")
    _clip(root / "badvideo.mkv", 4, "matroska", "mpeg4")
    data = (root / "badvideo.mkv").read_bytes()
    (root / "badvideo.mkv").write_bytes(data[: len(data) // 2])
    (root / "badvideo.txt").write_text("half a video")
    (root / "zz_dup.png").write_bytes(good)
    (root / "zz_dup.txt").write_text("same pixels, other words")
    img("zz_dupcap.png", color=(1, 99, 1), caption=None)
    (root / "zz_dupcap.txt").write_text((root / "shape_001.txt").read_text())
    if not ROOT_USER:
        img("locked.png")
        (root / "locked.png").chmod(0)

    (root / "orphan.txt").write_text("lonely")
    (root / "notes.md").write_text("not data")
    (root / ".hidden.png").write_bytes(b"ignored")
    (root / "broken.png").symlink_to(root / "gone.png")
    (root / "selfloop.png").symlink_to(root / "selfloop.png")
    (root / "loop").symlink_to(root)
    with open(os.path.join(os.fsencode(root), b"bad\xff.png"), "wb") as f:
        f.write(good)
    return root


def _tree_digest(root: Path) -> str:
    """Names, modes, mtimes and bytes of everything under root (links not followed)."""
    h = hashlib.sha256()
    for folder, dirs, files in os.walk(os.fsencode(root)):
        for name in sorted(dirs + files):
            p = os.path.join(folder, name)
            st = os.lstat(p)
            h.update(p + f"|{st.st_mode}|{st.st_mtime_ns}".encode())
            if os.path.isfile(p) and not os.path.islink(p) and os.access(p, os.R_OK):
                with open(p, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def _ds(root: Path, **kw) -> DatasetConfig:
    return DatasetConfig(name=kw.pop("name", "d"), path=str(root), resolution=32, **kw)


def _run(tmp_path, datasets, vcfg=VCFG, **kw):
    out = tmp_path / "out"
    return run_validation(
        datasets if isinstance(datasets, list) else [_ds(datasets)],
        vcfg,
        manifest_path=out / "manifest.parquet",
        report_json=out / "report.json",
        report_html=out / "report.html",
        **kw,
    )


def _rows(tmp_path) -> dict[str, dict]:
    return {
        r["relpath"]: r for r in pq.read_table(tmp_path / "out" / "manifest.parquet").to_pylist()
    }


@pytest.fixture(scope="module")
def tokens():
    return FamilyTokenCounter(ModelConfig())  # the tiny SD family's real CLIP tokenizer (77 tokens)


@pytest.fixture
def dataset(tmp_path):
    return _make_dataset(tmp_path / "data")


def test_dataset_files_are_snakemake_safe(dataset, tmp_path):
    ds = _ds(dataset)
    files = dataset_files(ds, VCFG)
    rels = [p.relative_to(dataset).as_posix() for p in files]
    assert files == sorted(files) and all(p.is_absolute() for p in files)
    assert set(EXPECTED) <= set(rels)
    assert "orphan.txt" in rels and "sub/deeper/nested.txt" in rels
    assert "notes.md" not in rels and ".hidden.png" not in rels
    assert not {"broken.png", "selfloop.png"} & set(rels) and not any(
        "bad" in r and "xff" in r for r in rels
    )
    assert all(p.exists() for p in files)  # nothing Snakemake would call a missing input
    assert dataset_files(_ds(tmp_path / "none"), VCFG) == []


def test_every_problem_found_good_files_kept_dataset_untouched(dataset, tmp_path, tokens):
    before = _tree_digest(dataset)
    result = _run(tmp_path, dataset, tokens=tokens, workers=2)
    assert _tree_digest(dataset) == before  # not a byte, mode or mtime changed

    by_rel = _rows(tmp_path)
    assert set(by_rel) == set(EXPECTED)
    for rel, reasons in EXPECTED.items():
        assert by_rel[rel]["reasons"] == reasons, (rel, by_rel[rel]["notes"])
        status = "ok" if not reasons else "warning" if set(reasons) <= WARN_ONLY else "skipped"
        assert by_rel[rel]["status"] == status, rel
    assert [r["id"] for r in by_rel.values()] != [] and by_rel["shape_000.png"]["id"] == item_id(
        "d", "shape_000.png"
    )

    good = by_rel["shape_001.png"]
    assert good["sha256"] == hashlib.sha256((dataset / "shape_001.png").read_bytes()).hexdigest()
    assert good["caption"] == (dataset / "shape_001.txt").read_text().strip() == good["captions"][0]
    assert (good["width"], good["height"], good["frames"], good["kind"], good["split"]) == (
        32,
        32,
        1,
        "image",
        "train",
    )
    assert (
        good["tokens"]
        and good["tokens"][0]["encoder"] == "clip"
        and good["tokens"][0]["limit"] == 77
    )
    assert (by_rel["rotated.jpg"]["width"], by_rel["rotated.jpg"]["height"]) == (20, 40)
    assert by_rel["multi.png"]["captions"] == ["first caption", "second caption"]
    clip = by_rel["clip.mp4"]
    assert (clip["kind"], clip["frames"], clip["fps"], clip["width"]) == ("video", 8, 8.0, 32)
    assert (by_rel["anim.gif"]["kind"], by_rel["anim.gif"]["frames"]) == ("video", 3)
    assert by_rel["short.webm"]["frames"] == 1
    long = by_rel["long_caption.png"]
    assert long["tokens"][0]["tokens"] > 77 and "over its limit of 77" in long["notes"][0]

    kept = [r for r, reasons in EXPECTED.items() if set(reasons) <= WARN_ONLY]
    assert result.kept == len(kept) and result.items == len(EXPECTED)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    flagged = {
        (Path(i["path"]).relative_to(dataset).as_posix(), i["reason"]) for i in report["issues"]
    }
    assert NOT_ROWS <= flagged
    for rel, reasons in EXPECTED.items():
        assert {(rel, r) for r in reasons} <= flagged
    assert set(report["counts"]) <= set(REASONS) and all(i["message"] for i in report["issues"])
    assert report["summary"]["errors"] == result.errors == 0
    latin = next(i for i in report["issues"] if i["reason"] == "caption_not_utf8")
    assert "byte offset 3" in latin["message"] and latin["path"].endswith("latin1.png")
    html = (tmp_path / "out" / "report.html").read_text()
    assert html.count("data:image/jpeg;base64,") >= 10  # flagged images and a video frame
    assert 'id="corrupt_media"' in html and 'id="broken_symlink"' in html


def test_sharded_validation_equals_one_job_and_reprobes_one_shard(dataset, tmp_path, tokens):
    """Probe tables of 3 validation shards, then the merging job: the same manifest and reports as one
    job, without reading the shards' files again; a changed file is probed again by its shard alone."""
    from diffpipe.data.dataset.discover import vshard_names, vshard_of
    from diffpipe.data.dataset.vshards import run_shard

    vcfg = VCFG.model_copy(update={"shards": 3})
    single = _run(tmp_path / "one", dataset, tokens=tokens, workers=1)
    probes = [tmp_path / "probe" / f"{n}.parquet" for n in vshard_names(3)]
    shards = [run_shard([_ds(dataset)], vcfg, shard=n, shards=3, out_path=p, workers=1)
              for n, p in zip(vshard_names(3), probes, strict=True)]
    assert sum(s.files for s in shards) == sum(s.probed for s in shards) >= len(EXPECTED)
    merged = _run(tmp_path / "sharded", dataset, vcfg, tokens=tokens, workers=1, probes=tuple(probes))
    assert (merged.items, merged.kept, merged.counts) == (single.items, single.kept, single.counts)
    assert merged.sharded >= len(EXPECTED) - 1 and merged.hashed == merged.items - merged.sharded <= 1  # unreadable
    one, many = tmp_path / "one" / "out", tmp_path / "sharded" / "out"
    assert pq.read_table(one / "manifest.parquet").equals(pq.read_table(many / "manifest.parquet"))
    for name in ("report.json", "report.html"):
        assert (one / name).read_text() == (many / name).read_text().replace(str(many), str(one))

    st = (dataset / "shape_001.png").stat()
    os.utime(dataset / "shape_001.png", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    again = [run_shard([_ds(dataset)], vcfg, shard=n, shards=3, out_path=p, workers=1)
             for n, p in zip(vshard_names(3), probes, strict=True)]
    home = vshard_of("d", "shape_001.png", 3)
    assert [s.probed for s in again] == [1 if i == home else (1 if "locked.png" in EXPECTED and
                                         vshard_of("d", "locked.png", 3) == i else 0) for i in range(3)]
    assert [s.changed for s in again] == [i == home for i in range(3)]


def test_chunks_of_four_items_give_the_same_manifest_and_reports(dataset, tmp_path, tokens, monkeypatch):
    """Validation holds a chunk of items as dicts at a time, and gets the folder's files from the walk three at
    a time, as columns: duplicates across chunks, orphan captions, eval files, a missing mask folder (one issue,
    not one per chunk) and the rerun's reuse come out as in one chunk of one batch."""
    from diffpipe.data.dataset import columnar, discover

    ds = _ds(dataset, eval_files=["shape_000.png", "nope.png"], mask_path=str(tmp_path / "no-masks"))
    whole = _run(tmp_path / "whole", [ds], tokens=tokens, workers=1)
    monkeypatch.setattr(columnar, "CHUNK", 4)
    monkeypatch.setattr(discover, "BATCH_FILES", 3)
    small = _run(tmp_path / "small", [ds], tokens=tokens, workers=1)
    a, b = tmp_path / "whole" / "out", tmp_path / "small" / "out"
    assert pq.read_table(a / "manifest.parquet").equals(pq.read_table(b / "manifest.parquet"))
    for name in ("report.json", "report.html"):
        assert (a / name).read_text() == (b / name).read_text().replace(str(b), str(a))
    assert (small.items, small.kept, small.counts) == (whole.items, whole.kept, whole.counts)
    assert small.counts["missing_dataset"] == 1 and small.counts["duplicate_media"] == 1
    assert small.counts["missing_file"] == 1 and small.datasets["d"]["eval"] == 1
    again = _run(tmp_path / "small", [ds], tokens=tokens, workers=1)
    unreadable = sum("unreadable" in r for r in EXPECTED.values())
    assert (again.reused, again.hashed, again.manifest_changed) == (again.items - unreadable, unreadable, False)


def test_rerun_reads_no_content_and_keeps_manifest(tmp_path, tokens):
    root = tmp_path / "data"
    write_demo_dataset(root, n=6, size=32)
    (root / "orphan.txt").write_text("x")
    first = _run(tmp_path, root, tokens=tokens)
    manifest = tmp_path / "out" / "manifest.parquet"
    html = tmp_path / "out" / "report.html"
    content = manifest.read_bytes()
    os.utime(manifest, ns=(1, 1))
    os.utime(html, ns=(1, 1))

    class NoTokens:  # counting again would mean the captions were not reused
        key = tokens.key

        def limits(self):
            raise AssertionError("tokenizer used on an unchanged dataset")

        count = limits

    second = _run(tmp_path, root, tokens=NoTokens())
    assert not second.manifest_changed and second.hashed == 0 and second.captions_read == 0
    assert second.reused == first.items == 6
    assert manifest.read_bytes() == content and manifest.stat().st_mtime_ns > 1  # touched only
    assert html.stat().st_mtime_ns > 1

    # Swap an image's bytes for others of the same size and restore its mtime: an
    # incremental run cannot notice without reading, so the old hash proves nothing
    # was read; rehash=True reads and sees the change.
    target = root / "shape_002.png"
    st = target.stat()
    old_sha = hashlib.sha256(target.read_bytes()).hexdigest()
    target.write_bytes(bytes(b ^ 0xFF for b in target.read_bytes()))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    third = _run(tmp_path, root, tokens=tokens)
    assert third.hashed == 0 and _rows(tmp_path)["shape_002.png"]["sha256"] == old_sha
    fourth = _run(tmp_path, root, rehash=True, tokens=tokens)
    row = _rows(tmp_path)["shape_002.png"]
    assert fourth.hashed == fourth.items == fourth.captions_read and fourth.manifest_changed
    assert row["sha256"] != old_sha and row["reasons"] == ["corrupt_media"]

    # A new mtime makes just that file read again; an edited caption is seen alone.
    os.utime(root / "shape_000.png", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    (root / "shape_001.txt").write_text("a purple star")
    fifth = _run(tmp_path, root, tokens=tokens)
    assert fifth.hashed == 1 and fifth.captions_read == 1 and fifth.manifest_changed
    assert _rows(tmp_path)["shape_001.png"]["caption"] == "a purple star"


def test_metadata_files_splits_and_policy(tmp_path):
    hf = tmp_path / "hf"
    write_demo_dataset(hf, n=4, size=32)
    for p in hf.glob("*.txt"):
        p.unlink()
    (tmp_path / "outside.png").write_bytes((hf / "shape_000.png").read_bytes())
    lines = [
        {"file_name": "shape_000.png", "text": "a cat"},
        {"file_name": "shape_001.png", "text": ["alt one", "alt two"]},
        {"file_name": "shape_002.png", "text": None},
        {"file_name": "missing.png", "text": "x"},
        {"file_name": "../outside.png", "text": "y"},
    ]
    (hf / "metadata.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    (hf / "test").mkdir()  # imagefolder split folders: paths relative to their metadata file
    (hf / "test" / "held.png").write_bytes((hf / "shape_003.png").read_bytes()[:-8] + b"12345678")
    (hf / "test" / "metadata.jsonl").write_text(json.dumps({"file_name": "held.png", "text": "split caption"}))
    tags = tmp_path / "tags"
    write_demo_dataset(tags, n=4, size=32)
    for p in tags.glob("*.txt"):
        p.unlink()
    (tags / "list.csv").write_text(
        "img,desc\n" + "".join(f'shape_00{i}.png,"cat,  dog,,cat, {i}"\n' for i in range(4))
    )
    pqdir = tmp_path / "pq"
    write_demo_dataset(pqdir, n=2, size=32)
    pq.write_table(
        pa.table({"file": ["shape_000.png"], "caption": [["p one", "p two"]]}),
        pqdir / "metadata.parquet",
    )
    datasets = [
        _ds(hf, name="hf", eval_files=["shape_000.png"]),
        _ds(
            tags,
            name="tags",
            metadata="list.csv",
            file_column="img",
            caption_column="desc",
            caption_style="tags",
            eval_fraction=0.5,
            eval_seed=3,
        ),
        _ds(pqdir, name="pq"),
    ]
    result = _run(tmp_path, datasets)
    rows = {
        (r["dataset"], r["relpath"]): r
        for r in pq.read_table(tmp_path / "out" / "manifest.parquet").to_pylist()
    }
    assert (
        rows["hf", "shape_000.png"]["captions"] == ["a cat"]
        and rows["hf", "shape_000.png"]["split"] == "eval"
    )
    assert rows["hf", "shape_001.png"]["captions"] == ["alt one", "alt two"]
    assert rows["hf", "shape_002.png"]["reasons"] == ["missing_caption"]
    assert rows["hf", "shape_003.png"]["reasons"] == ["missing_caption"]
    assert rows["hf", "test/held.png"]["captions"] == ["split caption"]
    assert rows["tags", "shape_002.png"]["caption"] == "cat, dog, 2"
    assert {rows["tags", f"shape_00{i}.png"]["split"] for i in range(4)} == {"train", "eval"}
    assert rows["pq", "shape_000.png"]["captions"] == ["p one", "p two"]
    assert (
        rows["pq", "shape_001.png"]["caption"] == (pqdir / "shape_001.txt").read_text().strip()
    )  # file fallback
    counts = result.counts
    assert counts["path_outside_root"] == 1 and counts["missing_file"] == 1 and result.errors == 1
    assert result.datasets["hf"]["eval"] == 1

    # Same data, other actions: the outside path only warns, a missing caption stops the run.
    vcfg = ValidationConfig(
        min_frames=2, actions={"path_outside_root": "warn", "missing_caption": "error"}
    )
    again = _run(tmp_path, datasets, vcfg)
    assert (
        again.errors == counts["missing_caption"] == 2
        and rows["hf", "shape_002.png"]["status"] == "skipped"
    )
    manifest = pq.read_table(tmp_path / "out" / "manifest.parquet").to_pylist()
    after = {(r["dataset"], r["relpath"]): r["status"] for r in manifest}
    assert after["hf", "shape_002.png"] == "error" and after["hf", "shape_000.png"] == "ok"
    issue = next(i for i in again.issues if i.reason == "path_outside_root")
    assert issue.action == "warn" and "outside the dataset folder" in issue.message


def test_bad_metadata_and_missing_or_empty_dataset(tmp_path):
    result = _run(tmp_path, tmp_path / "nowhere")
    assert result.errors == 1 and result.counts == {"missing_dataset": 1}
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "orphan.txt").write_text("x")
    result = _run(tmp_path, empty)
    assert result.errors == 1 and result.counts == {"no_media": 1, "orphan_caption": 1}
    (empty / "metadata.json").write_text("{not json")
    result = _run(tmp_path, empty)
    assert result.counts["bad_metadata"] == 1


def test_unreadable_file_is_reported(tmp_path):
    # A folder named like an image cannot be read as a file, even by root.
    (tmp_path / "x.png").mkdir()
    p = probe(str(tmp_path / "x.png"), "image", 10**6)
    assert [r for r, _ in p.problems] == ["unreadable"] and p.sha256 is None


def test_cli_exits_1_on_errors_with_the_summary_last(tmp_path):
    from typer.testing import CliRunner

    from diffpipe.cli import app

    data = tmp_path / "data"
    write_demo_dataset(data, n=2, size=32)
    (data / "metadata.csv").write_text("file_name,caption\n../elsewhere.png,x\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({"output_dir": str(tmp_path / "run"), "datasets": [{"name": "d", "path": str(data), "resolution": 32}]}))
    res = CliRunner().invoke(app, ["validate", "-c", str(cfg), "--no-tokens"])
    assert res.exit_code == 1, res.output
    tail = res.output.strip().splitlines()
    assert "error(s)" in tail[-1] and any("path_outside_root" in line for line in tail)
    assert any("elsewhere.png" in line for line in tail[:-3])  # each error is printed before the summary
    out = tmp_path / "run" / "validate"
    assert (out / "report.failed.html").is_file() and (out / "manifest.failed.parquet").is_file()
    for f in ("manifest.parquet", "report.json", "report.html"):
        (out / f).unlink()  # what Snakemake does to a failed job's outputs
    (data / "metadata.csv").unlink()
    res = CliRunner().invoke(app, ["validate", "-c", str(cfg), "--no-tokens"])
    assert res.exit_code == 0 and "2 of 2 items kept" in res.output.strip().splitlines()[-1]
    assert not (out / "report.failed.html").exists() and (out / "report.html").is_file()


def test_a_crashing_decoder_costs_only_its_file(tmp_path, monkeypatch):
    import diffpipe.data.dataset.media as media
    import diffpipe.data.dataset.pool as pool

    data = tmp_path / "data"
    write_demo_dataset(data, n=4, size=32)
    (data / "crash.png").write_bytes((data / "shape_000.png").read_bytes()[:-1] + b"!")
    (data / "crash.txt").write_text("boom")
    real = media.probe

    def probe(path, kind, max_pixels):  # forked workers inherit the patch
        if path.endswith("crash.png"):
            os._exit(3)  # what a segfaulting decoder looks like from outside
        return real(path, kind, max_pixels)

    monkeypatch.setattr(media, "probe", probe)
    monkeypatch.setattr(pool, "CHUNK", 1)
    result = _run(tmp_path, data, workers=2)
    rows = _rows(tmp_path)
    assert rows["crash.png"]["reasons"] == ["corrupt_media"] and "crashed" in rows["crash.png"]["notes"][0]
    assert rows["crash.png"]["sha256"] and result.kept == 4


def test_a_run_folder_named_like_a_glob_pattern_is_still_a_path(tmp_path, tokens):
    """A run folder may hold ``[ ] * ?`` in its name: the manifest is read back as that path (polars would
    otherwise expand it as a pattern and find nothing), so the rerun reuses every item and the plan reads it."""
    from diffpipe.data.cache import plan_table

    root, runs = tmp_path / "data", tmp_path / "run [x] *?"
    write_demo_dataset(root, n=4, size=32)
    _run(runs, root, tokens=tokens)
    again = _run(runs, root, tokens=tokens)
    assert (again.reused, again.manifest_changed) == (again.items, False)
    items, _ = plan_table.read_items(runs / "out" / "manifest.parquet")
    assert items.height == again.items
