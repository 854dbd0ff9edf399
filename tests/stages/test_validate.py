import hashlib
import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from PIL import Image

from diffpipe.config import DatasetConfig, ValidationConfig
from diffpipe.data.demo import write_demo_dataset
from diffpipe.data.discover import dataset_files
from diffpipe.data.validate import REASONS, item_id, run_validation

VCFG = ValidationConfig(min_size=16)

# media file -> expected reason codes (empty: kept)
EXPECTED = {
    "shape_000.png": [],
    "shape_001.png": [],
    "shape_002.png": [],
    "sub/deeper/nested.png": [],
    "UPPER.PNG": [],
    "rotated.jpg": [],
    "no_caption.png": ["missing_caption"],
    "empty_caption.png": ["empty_caption"],
    "blank_caption.png": ["empty_caption"],
    "latin1.png": ["caption_not_utf8"],
    "truncated.png": ["corrupt_media"],
    "garbage.jpg": ["corrupt_media"],
    "zero.png": ["zero_byte"],
    "tiny.png": ["too_small"],
}


def _make_dataset(root: Path) -> Path:
    write_demo_dataset(root, n=3, size=32)
    good = (root / "shape_000.png").read_bytes()

    def img(rel, size=(32, 32), caption="a caption", **save):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", size, (10, 200, 30)).save(path, **save)
        if caption is not None:
            path.with_suffix(".txt").write_text(caption)

    img("sub/deeper/nested.png")
    img("UPPER.PNG")
    exif = Image.Exif()
    exif[0x0112] = 6  # stored 40x20, shown 20x40
    img("rotated.jpg", size=(40, 20), exif=exif.tobytes())
    img("no_caption.png", caption=None)
    img("empty_caption.png", caption="")
    img("blank_caption.png", caption=" \n\t ")
    img("latin1.png", caption=None)
    (root / "latin1.txt").write_bytes("café au lait".encode("latin-1"))
    (root / "truncated.png").write_bytes(good[: len(good) // 2])
    (root / "truncated.txt").write_text("cut")
    (root / "garbage.jpg").write_bytes(b"\xff\xd8 definitely not a jpeg" * 10)
    (root / "garbage.txt").write_text("junk")
    (root / "zero.png").write_bytes(b"")
    (root / "zero.txt").write_text("nothing")
    img("tiny.png", size=(8, 40))
    (root / "orphan.txt").write_text("lonely")
    (root / "notes.md").write_text("not data")
    (root / ".hidden.png").write_bytes(b"ignored")
    return root


def _tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        h.update(f"{p.relative_to(root)}|{st.st_mode}|{st.st_mtime_ns}".encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def _run(tmp_path, root, **kw):
    out = tmp_path / "out"
    return run_validation(
        [DatasetConfig(name="d", path=str(root))],
        VCFG,
        manifest_path=out / "manifest.parquet",
        report_json=out / "report.json",
        report_html=out / "report.html",
        **kw,
    )


@pytest.fixture
def dataset(tmp_path):
    return _make_dataset(tmp_path / "data")


def test_dataset_files_lists_media_and_captions(dataset, tmp_path):
    ds = DatasetConfig(name="d", path=str(dataset))
    files = dataset_files(ds, VCFG)
    rels = [p.relative_to(dataset).as_posix() for p in files]
    assert files == sorted(files) and all(p.is_absolute() for p in files)
    assert set(EXPECTED) <= set(rels)
    assert "orphan.txt" in rels and "sub/deeper/nested.txt" in rels
    assert "notes.md" not in rels and ".hidden.png" not in rels
    (dataset / "broken.png").symlink_to(dataset / "gone.png")
    (dataset / "loop").symlink_to(dataset)
    assert dataset_files(ds, VCFG) == files  # a broken link and a link loop are skipped
    assert dataset_files(DatasetConfig(name="x", path=str(tmp_path / "none")), VCFG) == []


def test_reasons_kept_files_and_untouched_dataset(dataset, tmp_path):
    before = _tree_digest(dataset)
    result = _run(tmp_path, dataset)
    assert _tree_digest(dataset) == before  # not a byte, mode or mtime changed

    rows = pq.read_table(tmp_path / "out" / "manifest.parquet").to_pylist()
    by_rel = {r["relpath"]: r for r in rows}
    assert set(by_rel) == set(EXPECTED)
    for rel, reasons in EXPECTED.items():
        assert by_rel[rel]["reasons"] == reasons, rel
        assert by_rel[rel]["status"] == ("ok" if not reasons else "skipped"), rel
    assert [r["id"] for r in rows] == sorted(r["id"] for r in rows)
    assert by_rel["shape_000.png"]["id"] == item_id("d", "shape_000.png")
    assert len(by_rel["shape_000.png"]["id"]) >= 16
    good = by_rel["shape_001.png"]
    assert good["sha256"] == hashlib.sha256((dataset / "shape_001.png").read_bytes()).hexdigest()
    assert good["caption"] == (dataset / "shape_001.txt").read_text().strip()
    assert good["caption_sha256"] == hashlib.sha256(good["caption"].encode()).hexdigest()
    assert (good["width"], good["height"], good["frames"]) == (32, 32, 1)
    assert good["path"] == str(dataset / "shape_001.png")
    assert (by_rel["rotated.jpg"]["width"], by_rel["rotated.jpg"]["height"]) == (20, 40)

    kept = sum(not r for r in EXPECTED.values())
    assert (result.items, result.kept, result.skipped) == (
        len(EXPECTED),
        kept,
        len(EXPECTED) - kept,
    )
    assert (result.errors, result.warnings) == (0, 1)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["counts"] == {
        "caption_not_utf8": 1,
        "corrupt_media": 2,
        "empty_caption": 2,
        "missing_caption": 1,
        "orphan_caption": 1,
        "too_small": 1,
        "zero_byte": 1,
    }
    assert set(report["counts"]) <= set(REASONS)
    latin = next(i for i in report["issues"] if i["reason"] == "caption_not_utf8")
    assert "byte offset 3" in latin["message"] and latin["path"].endswith("latin1.png")
    orphan = next(i for i in report["issues"] if i["reason"] == "orphan_caption")
    assert orphan["action"] == "warn" and orphan["path"].endswith("orphan.txt")
    html = (tmp_path / "out" / "report.html").read_text()
    assert html.count("data:image/jpeg;base64,") >= 4  # decodable flagged images
    assert "cannot decode" in html and 'id="corrupt_media"' in html


def test_rerun_reads_no_content_and_keeps_manifest(dataset, tmp_path):
    first = _run(tmp_path, dataset)
    manifest = tmp_path / "out" / "manifest.parquet"
    html = tmp_path / "out" / "report.html"
    content = manifest.read_bytes()
    os.utime(manifest, ns=(1, 1))
    os.utime(html, ns=(1, 1))
    second = _run(tmp_path, dataset)
    assert not second.manifest_changed and second.hashed == 0 and second.reused == first.items
    assert manifest.read_bytes() == content and manifest.stat().st_mtime_ns > 1  # touched only
    assert html.stat().st_mtime_ns > 1

    # Swap a good image's bytes for different ones of the same size and restore
    # its mtime: an incremental run cannot notice without reading, so the old
    # hash proves nothing was read; rehash=True reads and sees the change.
    target = dataset / "shape_002.png"
    st = target.stat()
    old_sha = hashlib.sha256(target.read_bytes()).hexdigest()
    target.write_bytes(bytes(b ^ 0xFF for b in target.read_bytes()))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    third = _run(tmp_path, dataset)
    row = {r["relpath"]: r for r in pq.read_table(manifest).to_pylist()}["shape_002.png"]
    assert third.hashed == 0 and row["sha256"] == old_sha and row["status"] == "ok"
    fourth = _run(tmp_path, dataset, rehash=True)
    row = {r["relpath"]: r for r in pq.read_table(manifest).to_pylist()}["shape_002.png"]
    assert fourth.hashed == fourth.items and fourth.manifest_changed
    assert row["sha256"] != old_sha and row["reasons"] == ["corrupt_media"]

    # A new mtime makes just that file read again.
    os.utime(dataset / "shape_000.png", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    fifth = _run(tmp_path, dataset)
    assert fifth.hashed == 1 and fifth.manifest_changed


def test_caption_edit_is_seen_without_rehash(dataset, tmp_path):
    _run(tmp_path, dataset)
    (dataset / "shape_000.txt").write_text("a purple star")
    result = _run(tmp_path, dataset)
    assert result.manifest_changed and result.hashed == 0
    rows = pq.read_table(tmp_path / "out" / "manifest.parquet").to_pylist()
    assert {r["relpath"]: r["caption"] for r in rows}["shape_000.png"] == "a purple star"


def test_missing_or_empty_dataset_is_an_error(tmp_path):
    result = _run(tmp_path, tmp_path / "nowhere")
    assert result.errors == 1 and result.counts == {"missing_dataset": 1}
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "orphan.txt").write_text("x")
    result = _run(tmp_path, empty)
    assert result.errors == 1 and result.counts == {"no_media": 1, "orphan_caption": 1}
