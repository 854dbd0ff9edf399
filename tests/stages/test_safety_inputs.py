"""Hostile dataset input (issue 14): bombs judged from headers, malformed metadata as reason
codes, user text printed literally, a dataset with no usable item stopped at validate."""

import io
import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from rich.console import Console
from stage_cli import in_process

from diffpipe.config import CacheConfig, DatasetConfig, ModelConfig, ValidationConfig
from diffpipe.data.cache import buckets, video
from diffpipe.data.cache.plan import make_plan
from diffpipe.data.dataset import media
from diffpipe.data.dataset.demo import write_demo_dataset
from diffpipe.data.dataset.metadata import read_metadata
from diffpipe.data.dataset.validate import print_summary, run_validation
from diffpipe.paths import RunPaths
from diffpipe.policy import REASONS, resolve_actions, status_of

LIMIT = ValidationConfig(max_pixels=1_000_000)


def gif(screen: tuple[int, int], frames: list[tuple[int, int, int, int]]) -> bytes:
    """A GIF of blank frames ``(left, top, width, height)``: a few bytes declaring any size."""
    out = b"GIF89a" + struct.pack("<HHBBB", *screen, 0x80, 0, 0) + b"\x00\x00\x00\xff\xff\xff"
    for frame in frames:
        # Image descriptor, LZW minimum code size 2, one sub-block (clear + end codes), terminator.
        out += b"\x2c" + struct.pack("<HHHHB", *frame, 0) + b"\x02" + b"\x02\x2c\x00" + b"\x00"
    return out + b"\x3b"


BOMB = gif((16000, 16000), [(0, 0, 16000, 16000)])


def _clip(path: Path, size: tuple[int, int], n: int = 2) -> None:
    w, h = size
    with av.open(str(path), "w", format="mp4") as c:
        s = c.add_stream("mpeg4", rate=8)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        for _ in range(n):
            for p in s.encode(av.VideoFrame.from_ndarray(np.zeros((h, w, 3), np.uint8), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def _ds(root: Path, **kw) -> DatasetConfig:
    return DatasetConfig(name=kw.pop("name", "d"), path=str(root), resolution=32, **kw)


def _validate(tmp_path: Path, datasets, vcfg: ValidationConfig = LIMIT, **kw):
    out = tmp_path / "out"
    datasets = datasets if isinstance(datasets, list) else [_ds(datasets)]
    return run_validation(datasets, vcfg, manifest_path=out / "manifest.parquet", report_json=out / "report.json",
                          report_html=out / "report.html", workers=1, **kw)


def _rows(tmp_path: Path) -> dict[str, dict]:
    return {r["relpath"]: r for r in pq.read_table(tmp_path / "out" / "manifest.parquet").to_pylist()}


# -- 7: decompression bombs --------------------------------------------------------
_PEAK = textwrap.dedent(
    """
    import json, resource, sys
    from pathlib import Path
    from diffpipe.config import DatasetConfig, ValidationConfig
    from diffpipe.data.dataset.validate import run_validation
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    run_validation([DatasetConfig(name="d", path=str(root), resolution=32)], ValidationConfig(max_pixels=1_000_000),
                   manifest_path=out / "m.parquet", report_json=out / "r.json", report_html=out / "r.html", workers=1)
    print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024))
    """
)


def _peak_mib(root: Path, out: Path) -> int:
    res = subprocess.run([sys.executable, "-c", _PEAK, str(root), str(out)], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_gif_bomb_is_rejected_from_its_header_without_decoding(tmp_path):
    """The 35-byte GIF declaring a 16000x16000 screen: skipped, named by size, at no memory cost."""
    assert len(BOMB) == 35
    root = tmp_path / "data"
    write_demo_dataset(root, n=2, size=32)
    base = _peak_mib(root, tmp_path / "base")
    (root / "bomb.gif").write_bytes(BOMB)  # .gif is a video extension: PyAV would decode it
    (root / "bomb.txt").write_text("a bomb")
    peak = _peak_mib(root, tmp_path / "bomb")
    rows = {r["relpath"]: r for r in pq.read_table(tmp_path / "bomb" / "m.parquet").to_pylist()}
    bomb = rows["bomb.gif"]
    assert bomb["reasons"] == ["decompression_bomb"] and bomb["status"] == "skipped", bomb["notes"]
    assert "16000x16000" in bomb["notes"][0] and "1,000,000" in bomb["notes"][0]
    # Decoding it costs about 1 GiB (16000 x 16000 x 4 bytes); the header costs nothing measurable.
    assert peak - base < 64, (base, peak)


def test_gif_frames_beyond_the_screen_count(tmp_path):
    """Pillow grows a GIF's canvas to hold a frame placed outside the screen: the header says so."""
    from diffpipe.data.dataset import headers

    small = gif((64, 64), [(0, 0, 64, 64), (5000, 5000, 64, 64)])
    assert headers.declared_size(io.BytesIO(small)) == ("gif", 5064, 5064)
    for kind in ("image", "video"):
        path = tmp_path / f"far_{kind}.gif"
        path.write_bytes(small)
        p = media.probe(str(path), kind, 1_000_000)
        assert [r for r, _ in p.problems] == ["decompression_bomb"] and "5064x5064" in p.problems[0][1], kind


def _encoded(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def test_every_image_format_declares_its_size_in_the_header():
    """The header reader agrees with Pillow on each format, and finds the largest page or frame."""
    from diffpipe.data.dataset import headers

    img = Image.new("RGB", (37, 21), (9, 99, 199))
    for fmt, name in (("PNG", "png"), ("JPEG", "jpeg"), ("WEBP", "webp"), ("TIFF", "tiff"), ("BMP", "bmp"),
                      ("GIF", "gif")):
        assert headers.declared_size(io.BytesIO(_encoded(img, fmt))) == (name, 37, 21), fmt
    assert headers.declared_size(io.BytesIO(_encoded(img, "JPEG", progressive=True)))[1:] == (37, 21)
    assert headers.declared_size(io.BytesIO(_encoded(img, "WEBP", lossless=True)))[1:] == (37, 21)
    anim = _encoded(img.convert("RGBA"), "WEBP", save_all=True, append_images=[img.convert("RGBA")])
    assert headers.declared_size(io.BytesIO(anim))[1:] == (37, 21)  # VP8X canvas
    pages = _encoded(img, "TIFF", save_all=True, append_images=[Image.new("RGB", (300, 200))])
    assert headers.declared_size(io.BytesIO(pages)) == ("tiff", 300, 200)  # the largest page
    assert headers.declared_size(io.BytesIO(b"not an image at all")) is None
    assert headers.declared_size(io.BytesIO(_encoded(img, "PNG")[:20])) is None  # cut inside the header


def test_video_stream_size_is_checked_before_decoding(tmp_path):
    _clip(tmp_path / "big.mp4", (1200, 1000))
    p = media.probe(str(tmp_path / "big.mp4"), "video", 1_000_000)
    assert [r for r, _ in p.problems] == ["decompression_bomb"], p.problems
    assert "1200x1000" in p.problems[0][1] and (p.width, p.height) == (1200, 1000)
    ok = media.probe(str(tmp_path / "big.mp4"), "video", 2_000_000)
    assert not ok.problems and ok.frames == 2


def test_large_images_warn_with_their_size(tmp_path):
    """Under the limit but slow to cache: kept, with a warning naming the size."""
    (tmp_path / "large.png").write_bytes(_encoded(Image.new("1", (4200, 4100)), "PNG"))
    p = media.probe(str(tmp_path / "large.png"), "image", ValidationConfig().max_pixels)
    assert [r for r, _ in p.problems] == ["large_media"] and "4200x4100" in p.problems[0][1]
    assert REASONS["large_media"][0] == "warn" and status_of(["large_media"], resolve_actions()) == "warning"
    (tmp_path / "normal.png").write_bytes(_encoded(Image.new("1", (4000, 3000)), "PNG"))
    assert not media.probe(str(tmp_path / "normal.png"), "image", ValidationConfig().max_pixels).problems


def test_cache_decoders_check_the_header_again(tmp_path):
    (tmp_path / "bomb.gif").write_bytes(BOMB)
    _clip(tmp_path / "big.mp4", (1200, 1000))
    with pytest.raises(ValueError, match="16000x16000"):
        buckets.load_image_array(io.BytesIO(BOMB), (32, 32), max_pixels=1_000_000)
    with pytest.raises(ValueError, match="16000x16000"):
        buckets.load_mask_array(io.BytesIO(BOMB), (32, 32), max_pixels=1_000_000)
    with pytest.raises(ValueError, match="16000x16000"):
        video.load_video_array(tmp_path / "bomb.gif", (32, 32), [0], max_pixels=1_000_000)
    with pytest.raises(ValueError, match="1200x1000"):
        video.load_video_array(tmp_path / "big.mp4", (32, 32), [0], max_pixels=1_000_000)
    assert video.load_video_array(tmp_path / "big.mp4", (32, 32), [0, 1], max_pixels=2_000_000).shape == (
        3, 2, 32, 32)


def test_a_swapped_in_bomb_stops_the_cache_job_naming_it(tmp_path):
    """validation.max_pixels reaches the cache job through the plan: a file swapped for a bomb
    after validation (and trusted, not re-hashed) is refused from its header."""
    from diffpipe.cache_jobs import cache_latents
    from diffpipe.families import get_family

    root = tmp_path / "data"
    write_demo_dataset(root, n=2, size=32)
    ds, cache_cfg = _ds(root), CacheConfig(shards=1)
    paths = RunPaths(tmp_path / "run")
    run_validation([ds], LIMIT, manifest_path=paths.manifest, report_json=paths.report_json,
                   report_html=paths.report_html, workers=1)
    family = get_family(ModelConfig())
    make_plan(paths.manifest, [ds], cache_cfg, latent_identity=family.vae_identity(),
              text_identity=family.text_identity(), pixel_multiple=family.pixel_multiple, paths=paths)
    shard = paths.shard_names()[0]
    assert json.loads(paths.latent_spec(shard).read_text())["max_pixels"] == 1_000_000
    (root / "shape_000.png").write_bytes(BOMB)
    with pytest.raises(ValueError, match=r"shape_000\.png.*16000x16000"):
        cache_latents(paths.latent_spec(shard), paths.latent_shard(shard), ModelConfig(), cache_cfg, trust=True,
                      workers=0)


# -- 8: malformed metadata ---------------------------------------------------------
def _parquet(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


# (file name, content, reason, words the message must hold besides the file name)
MALFORMED = {
    "unquoted comma": ("metadata.csv", b"file_name,caption\nshape_000.png,a cat, on a mat\nshape_001.png,ok\n",
                       "bad_metadata", ["row 1", "line 2", "3 fields", "quote"]),
    "short row": ("metadata.csv", b"file_name,caption\nshape_000.png\nshape_001.png,ok\n", "bad_metadata",
                  ["row 1", "line 2", "1 field"]),
    "csv not utf-8": ("metadata.csv", b"file_name,caption\nshape_000.png,caf\xe9\n", "bad_metadata",
                      ["UTF-8", "line 2"]),
    "bad json": ("metadata.json", b'[{"file_name": "shape_000.png",', "bad_metadata", ["not valid JSON", "line 1"]),
    "nested json": ("metadata.json", b"[" * 100_000, "bad_metadata", ["nested"]),
    "json record not an object": ("metadata.json", b'[{"file_name": "shape_000.png", "text": "a"}, 5]',
                                  "bad_metadata", ["record 2", "a number"]),
    "jsonl line not an object": ("metadata.jsonl", b'{"file_name": "shape_000.png", "text": "a"}\n[1, 2]\n',
                                 "bad_metadata", ["line 2", "a list"]),
    "jsonl bad line": ("metadata.jsonl", b'{"file_name": "shape_000.png", "text": "a"}\n{"file_name": \n',
                       "bad_metadata", ["line 2", "not valid JSON"]),
    "file not text": ("metadata.json", b'[{"file_name": 5, "text": "a"}]', "bad_metadata", ["row 1", "not text"]),
    "path with a NUL": ("metadata.jsonl", b'{"file_name": "shape\\u0000.png", "text": "a"}', "bad_metadata",
                        ["row 1", "control character"]),
    "path too long": ("metadata.jsonl", b'{"file_name": "' + b"a" * 300 + b'.png", "text": "a"}',
                      "missing_file", ["row 1", "too long"]),
    "caption not text": ("metadata.jsonl", b'{"file_name": "shape_000.png", "text": {"a": 1}}', "empty_caption",
                         ["row 1", "dict"]),
    "no caption column": ("metadata.jsonl", b'{"file_name": "shape_000.png", "words": "a"}', "bad_metadata",
                          ["no caption column", "words"]),
    "empty csv": ("metadata.csv", b"", "bad_metadata", ["is empty"]),
    "empty json": ("metadata.json", b"  \n", "bad_metadata", ["is empty"]),
    "empty jsonl": ("metadata.jsonl", b"", "bad_metadata", ["is empty"]),
    "empty parquet": ("metadata.parquet", b"", "bad_metadata", ["is empty"]),
    "garbage parquet": ("metadata.parquet", b"PAR1 not really", "bad_metadata", ["Parquet"]),
    "parquet wrong types": ("metadata.parquet", _parquet(pa.table({"file_name": [1, 2], "text": ["a", "b"]})),
                            "bad_metadata", ["row 1", "not text"]),
    "parquet no rows": ("metadata.parquet", _parquet(pa.table({"file_name": pa.array([], pa.string())})),
                        "bad_metadata", ["no caption column"]),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_metadata_is_a_reason_naming_file_and_row(tmp_path, case):
    name, content, reason, words = MALFORMED[case]
    root = tmp_path / "data"
    write_demo_dataset(root, n=2, size=32)
    (root / name).write_bytes(content)
    result = _validate(tmp_path, root)  # never raises
    found = [i for i in result.issues if i.reason == reason and name in i.message]
    assert found, [(i.reason, i.message) for i in result.issues]
    assert any(all(w in i.message for w in words) for i in found), [i.message for i in found]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert any(i["reason"] == reason and name in i["message"] for i in report["issues"])


def test_one_bad_row_costs_only_that_row(tmp_path):
    root = tmp_path / "data"
    write_demo_dataset(root, n=2, size=32)
    (root / "metadata.csv").write_text("file_name,caption\nshape_000.png,a, b\nshape_001.png,kept caption\n")
    _validate(tmp_path, root)
    assert _rows(tmp_path)["shape_001.png"]["caption"] == "kept caption"


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["file_name", "text", "x"]), inner,
                                                                max_size=3),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=_json, fmt=st.sampled_from(["json", "jsonl", "csv"]))
def test_metadata_of_any_shape_never_raises(tmp_path, value, fmt):
    text = json.dumps(value)
    if fmt == "jsonl":
        text = "\n".join(json.dumps(v) for v in (value if isinstance(value, list) else [value]))
    elif fmt == "csv":
        text = "file_name,text\n" + text.replace("\n", ",") + "\n"
    (tmp_path / f"m.{fmt}").write_text(text)
    table = read_metadata(tmp_path, [f"m.{fmt}"], None, None)
    assert all(p.reason in REASONS and "m." in p.note for p in table.problems)


# -- 11: no usable item ------------------------------------------------------------
def test_no_usable_item_fails_validate_with_the_counts(tmp_path):
    root = tmp_path / "data"
    write_demo_dataset(root, n=3, size=32)
    for p in root.glob("*.txt"):
        p.unlink()  # every item lacks its caption
    (root / "cut.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(10))
    (root / "cut.txt").write_text("a broken file")
    result = _validate(tmp_path, root)
    issue = next(i for i in result.issues if i.reason == "no_usable_items")
    assert issue.action == "error" and result.errors == 1
    for words in ("4 found", "missing_caption 3", "corrupt_media 1", "0 usable"):
        assert words in issue.message, issue.message

    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({"output_dir": str(tmp_path / "run"), "datasets": [{"name": "d", "path": str(root),
                                                                               "resolution": 32}]}))
    res = in_process("validate", "-c", str(cfg), "--no-tokens")
    assert res.returncode == 1, res.stdout + res.stderr
    err = " ".join(res.stderr.split())  # rich wraps at the terminal width
    assert "no_usable_items" in err and "4 found, 4 skipped" in err and "Traceback" not in err


def test_everything_held_for_eval_leaves_nothing_to_train(tmp_path):
    root = tmp_path / "data"
    write_demo_dataset(root, n=2, size=32)
    result = _validate(tmp_path, [_ds(root, eval_files=["shape_000.png", "shape_001.png"])])
    issue = next(i for i in result.issues if i.reason == "no_usable_items")
    assert "2 found" in issue.message and "2 held out for eval" in issue.message


def test_plan_refuses_an_empty_plan_with_the_counts(tmp_path):
    """With the validate error turned into a warning, the plan still stops before any cache job."""
    root = tmp_path / "data"
    write_demo_dataset(root, n=2, size=32)
    for p in root.glob("*.txt"):
        p.unlink()
    paths = RunPaths(tmp_path / "run")
    vcfg = ValidationConfig(actions={"no_usable_items": "warn"})
    run_validation([_ds(root)], vcfg, manifest_path=paths.manifest, report_json=paths.report_json,
                   report_html=paths.report_html, workers=1)
    with pytest.raises(ValueError, match=r"no item to train on.*2 in the manifest.*2 skipped"):
        make_plan(paths.manifest, [_ds(root)], CacheConfig(shards=1), latent_identity="v", text_identity="t",
                  pixel_multiple=8, paths=paths)


# -- 9: user text printed literally --------------------------------------------------
def test_square_brackets_in_paths_and_rows_print_literally(tmp_path):
    root = tmp_path / "d[bold]x[/x]"
    write_demo_dataset(root, n=2, size=32)
    (root / "metadata.csv").write_text("file_name,caption\n../[/x]out.png,a [red]caption\n")
    result = _validate(tmp_path, root)
    assert result.errors == 1
    console = Console(record=True, width=300, force_terminal=False)
    print_summary(result, console, report=tmp_path / "[/y]report.html")
    text = console.export_text()
    assert "../[/x]out.png" in text and "d[bold]x[/x]" in text and "[/y]report.html" in text
    page = (tmp_path / "out" / "report.html").read_text()
    assert "[/x]out.png" in page and "d[bold]x[/x]" in page


def test_a_symlink_into_the_run_folder_is_never_data(tmp_path):
    """The config refuses overlapping folders; a link inside the dataset could still reach the run."""
    from diffpipe.data.dataset.discover import dataset_files, run_folders
    from diffpipe.data.dataset.validate import run_validation

    root = tmp_path / "data"
    write_demo_dataset(root, n=2, size=32)
    run = tmp_path / "run"
    (run / "samples").mkdir(parents=True)
    (run / "samples" / "sample-00.png").write_bytes((root / "shape_000.png").read_bytes())
    (run / "samples" / "sample-00.txt").write_text("a sample")
    (root / "outputs").symlink_to(run)
    ds = DatasetConfig(name="d", path=str(root), resolution=32)
    exclude = run_folders(run, None)
    assert not [p for p in dataset_files(ds, ValidationConfig(), exclude) if "outputs" in str(p)]
    result = run_validation([ds], ValidationConfig(), manifest_path=tmp_path / "m" / "manifest.parquet",
                            report_json=tmp_path / "m" / "report.json", report_html=tmp_path / "m" / "report.html",
                            exclude=exclude)
    report = json.loads((tmp_path / "m" / "report.json").read_text())
    assert result.counts.get("run_folder") == 1, result.counts
    assert "outputs" in json.dumps(report)
