"""What keeps validation's memory near its columns at millions of items (#43)."""

from __future__ import annotations

import os
import subprocess
import sys

import pyarrow.parquet as pq

import diffpipe
from diffpipe.data.dataset import columnar
from diffpipe.data.dataset.manifest_file import MANIFEST_SCHEMA

_SHOW = "import os, sys, diffpipe; print(os.environ.get('_RJEM_MALLOC_CONF'), 'polars' in sys.modules)"


def _run(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", _SHOW], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_importing_diffpipe_has_polars_return_freed_memory_before_polars_loads():
    env = {k: v for k, v in os.environ.items() if k != "_RJEM_MALLOC_CONF"}
    assert _run(env) == f"{diffpipe.POLARS_MALLOC_CONF} False"
    # A user's own allocator setting stays.
    assert _run({**env, "_RJEM_MALLOC_CONF": "narenas:2"}) == "narenas:2 False"


def test_the_manifest_is_written_a_slice_at_a_time_in_its_schema(tmp_path, monkeypatch):
    monkeypatch.setattr(columnar, "WRITE_ROWS", 3)
    rows = [{"id": f"{i:016x}", "dataset": "d", "relpath": f"{i}.png", "reasons": [], "notes": []} for i in range(7)]
    frame, meta = columnar.rows_frame(rows), {"probe_key": "k"}
    path = tmp_path / "manifest.parquet"
    columnar.write_frame(path, frame, meta)
    with pq.ParquetFile(path) as f:
        assert f.metadata.num_row_groups == 3  # 3 + 3 + 1 rows: one slice converted to Arrow at a time
        table = f.read()
    assert table.schema.remove_metadata() == MANIFEST_SCHEMA
    assert table.schema.metadata[b"probe_key"] == b"k"
    assert table.equals(columnar.to_arrow(frame, meta))
    assert columnar.read_manifest(path)[0].equals(frame)


def test_an_empty_manifest_is_written_with_its_schema(tmp_path):
    path = tmp_path / "manifest.parquet"
    columnar.write_frame(path, columnar.empty(), {})
    assert columnar.read_manifest(path)[0].height == 0


def test_the_table_is_sorted_a_column_at_a_time_from_a_frame_handed_over():
    rows = [{"id": f"{(i * 7) % 11:016x}", "dataset": "d", "relpath": f"{i}.png", "width": i, "reasons": [str(i)],
             "notes": ["n"]} for i in range(11)]
    frame = columnar.rows_frame(rows)
    held = [frame.clone()]
    out = columnar.take_sorted(held, "id")
    assert held == []  # handed over: no second reference keeps the unsorted columns alive
    assert out.equals(frame.sort("id"))
    assert out.schema == frame.schema


def test_columns_a_chunk_leaves_empty_hold_no_buffer_and_are_written_in_the_schema(tmp_path):
    """~30 manifest columns are empty for plain image folders (fps, tokens, every aux role's six): as typed
    null columns they held 4-16 bytes a row each, 0.3 KiB per item at 100,000 files, in the chunks, the
    merged table and the previous manifest."""
    import polars as pl

    rows = [{"id": f"{i:016x}", "dataset": "d", "relpath": f"{i}.png", "reasons": [], "notes": []}
            for i in range(4096)]
    frame = columnar.rows_frame(rows)
    typed = pl.DataFrame({name: [row.get(name) for row in rows] for name in columnar.SCHEMA}, schema=columnar.SCHEMA)
    assert frame.cast(columnar.SCHEMA).equals(typed)
    used = typed.select("id", "dataset", "relpath", "reasons", "notes").estimated_size()
    assert frame.estimated_size() < used + 4096, (frame.estimated_size(), used, typed.estimated_size())
    merged = columnar.concat([frame, columnar.rows_frame([{**rows[0], "id": "f" * 16, "fps": 24.0}])])
    assert merged.schema["fps"] == pl.Float64 and merged["fps"].null_count() == 4096
    path = tmp_path / "manifest.parquet"
    columnar.write_frame(path, merged, {})
    with pq.ParquetFile(path) as f:
        assert f.schema_arrow.remove_metadata() == MANIFEST_SCHEMA
    back = columnar.read_manifest(path)[0]
    assert back.cast(columnar.SCHEMA).equals(merged.cast(columnar.SCHEMA))
    assert back.estimated_size() < merged.select("id", "dataset", "relpath", "reasons", "notes", "fps").estimated_size() + 4096


def test_the_previous_manifest_is_compared_a_slice_at_a_time(tmp_path, monkeypatch):
    """A rerun decides "unchanged" (the manifest kept, Snakemake's plan not rerun) against the file, a slice
    at a time, not against a second whole table held in memory."""
    monkeypatch.setattr(columnar, "WRITE_ROWS", 3)
    rows = [{"id": f"{i:016x}", "dataset": "d", "relpath": f"{i}.png", "width": i, "reasons": [], "notes": []}
            for i in range(8)]
    frame, meta, path = columnar.rows_frame(rows), {"probe_key": "k"}, tmp_path / "manifest.parquet"
    columnar.write_frame(path, frame, meta)
    import polars as pl

    reads = []
    real = pl.LazyFrame.collect
    monkeypatch.setattr(pl.LazyFrame, "collect", lambda self, **kw: reads.append(got := real(self, **kw)) or got)
    assert columnar.same_as_file(path, frame, meta)
    assert [r.height for r in reads] == [3, 3, 2]
    rows[7]["width"] = 70  # in the last row group
    assert not columnar.same_as_file(path, columnar.rows_frame(rows), meta)
    assert not columnar.same_as_file(path, frame, {"probe_key": "other"})
    assert not columnar.same_as_file(path, frame.head(7), meta)
    path.write_bytes(path.read_bytes()[:-20])  # damaged: written anew, never trusted
    assert not columnar.same_as_file(path, frame, meta)


def test_a_rerun_holds_only_the_columns_it_reuses_of_the_previous_manifest(tmp_path, monkeypatch):
    """The locator, caption text and hash, split and status are computed anew on every run: the previous
    manifest's copies of them (0.17 KiB of a table row's 0.5) are not read, and the rerun still keeps the
    manifest as it is."""
    from PIL import Image

    from diffpipe.config import DatasetConfig, ValidationConfig
    from diffpipe.data.dataset.validate import run_validation

    data = tmp_path / "data"
    data.mkdir()
    for i in range(3):
        Image.new("RGB", (64, 64), (40 * i, 0, 0)).save(data / f"{i}.png")
        (data / f"{i}.txt").write_text(f"caption {i}")
    held = []
    real = columnar.read_manifest
    monkeypatch.setattr(columnar, "read_manifest", lambda *a: held.append(got := real(*a)) or got)
    out = {k: tmp_path / f"out.{k}" for k in ("parquet", "json", "html")}

    def run():
        return run_validation([DatasetConfig(name="d", path=str(data))], ValidationConfig(), manifest_path=out["parquet"],
                              report_json=out["json"], report_html=out["html"], workers=1)

    first = run()
    again = run()
    assert held[-1][0] is not None
    assert not {"path", "caption", "caption_sha256", "split", "status"} & set(held[-1][0].columns)
    assert (first.manifest_changed, again.manifest_changed, again.reused) == (True, False, 3)


_GATHER = """
import polars as pl
from diffpipe.data.dataset import columnar

def peak_kib():  # VmHWM, reset below: this step's own peak, not the set-up's
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])

dt = columnar.SCHEMA["tokens"]
parts = [pl.DataFrame({"id": pl.Series([f"{(i * 7919 + k) % 160000:016x}" for i in range(4096)]),
                       "tokens": pl.Series([[] for _ in range(4096)], dtype=dt)}) for k in range(40)]
frame = pl.concat(parts, how="vertical_relaxed")
del parts
assert frame["tokens"].n_chunks() == 40
import gc; gc.collect()
open("/proc/self/clear_refs", "w").write("5")
before = peak_kib()
out = columnar.take_sorted([frame.clone()], "id")
print((peak_kib() - before) >> 10)
assert out.equals(frame.sort("id"))
"""


def test_sorting_a_list_column_of_many_chunks_costs_what_its_values_need():
    """The scan leaves one chunk per 8,192 rows; gathering a list column across them went through a builder
    that held ~0.7 KiB a row at the sort (400,000 sharded table rows: validate's peak 743 -> 585 MiB)."""
    out = subprocess.run([sys.executable, "-c", _GATHER], capture_output=True, text=True, check=True)
    grew_mib = int(out.stdout.split()[-1])
    assert grew_mib < 40, grew_mib  # 163,840 rows of empty token lists: ~110 MiB through the builder


def _folder(root, n: int) -> None:
    """``n`` distinct 32 px images with distinct captions (no duplicate, nothing too small: no issue per item)."""
    from PIL import Image

    root.mkdir(parents=True)
    for i in range(n):
        Image.new("RGB", (32, 32), (i % 256, i // 256 % 256, 7)).save(root / f"{i:05d}.png")
        (root / f"{i:05d}.txt").write_text(f"item {i}")


def _python_peak(tmp_path, n: int) -> int:
    import tracemalloc

    from diffpipe.config import DatasetConfig, ValidationConfig
    from diffpipe.data.dataset.validate import run_validation

    _folder(tmp_path / f"d{n}", n)
    ds = DatasetConfig(name="d", path=str(tmp_path / f"d{n}"), resolution=32)
    out = tmp_path / f"out{n}"
    tracemalloc.start()
    try:
        result = run_validation([ds], ValidationConfig(), manifest_path=out / "m.parquet",
                                report_json=out / "r.json", report_html=out / "r.html", workers=1)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        assert (result.items, result.kept) == (n, n)


def test_a_folders_files_reach_validation_as_columns_not_python_objects(tmp_path, monkeypatch):
    """A listing as Python objects (a path string, a (size, mtime) tuple, dict entries per media and caption
    file) held ~0.5 KiB an item through the scan: 507 MiB of validate's 2,307 at 1,000,000 files. The walk
    hands its files over a batch at a time and validation keeps them as columns, so the Python objects it
    holds at once no longer grow with the folder (the columns' buffers are not Python objects)."""
    from diffpipe.data.dataset import discover

    monkeypatch.setattr(columnar, "CHUNK", 256)
    monkeypatch.setattr(discover, "BATCH_FILES", 256)
    _python_peak(tmp_path, 10)  # what the first run imports is not the folder's
    small, large = _python_peak(tmp_path, 600), _python_peak(tmp_path, 3000)
    assert large - small < 2400 * 60, (small, large)  # was 1.6 KB per added item (3.8 MB)


def test_the_column_wise_listing_pairs_captions_as_the_dicts_did():
    """Each media file gets its same-stem caption file (of two with one stem, the later in path order, as a
    dict by stem kept it); orphans are the stems no media file has; metadata-named files join and aux images
    leave by path, a name that cannot be a file counting as not listed."""
    import os

    media = {"a.png": "image", "b.mp4": "video", "b.jpg": "image", "sub/c.d.png": "image"}
    captions = ["a.TXT", "a.txt", "b.txt", "sub/c.d.txt", "sub/c.txt", "z.txt"]
    stats = {rel: (i, 10 * i) for i, rel in enumerate([*media, *captions])}
    files = columnar.FolderFiles()
    files.add(dict(list(media.items())[:2]), captions[:3], stats)  # two batches, in no order
    files.add(dict(list(media.items())[2:]), captions[3:], stats)
    found, caps = files.tables()
    assert found["relpath"].to_list() == sorted(media) and caps["relpath"].to_list() == sorted(captions)
    assert found["stem"].to_list() == [os.path.splitext(r)[0] for r in sorted(media)]
    named = columnar.not_listed(found, ["a.png", "extra.bin", "bad\udcff.png", "b.jpg"])
    assert named == ["extra.bin", "bad\udcff.png"]
    found = columnar.with_files(columnar.without(found, {"b.jpg", "bad\udcff.png"}), ["extra.bin"], "image")
    joined, orphans = columnar.with_captions(found, caps)
    by_stem = {os.path.splitext(c)[0]: c for c in sorted(captions)}  # the dict the columns replace
    assert joined["relpath"].to_list() == ["a.png", "b.mp4", "extra.bin", "sub/c.d.png"]
    assert joined["caption_file"].to_list() == [by_stem.get(os.path.splitext(r)[0]) for r in joined["relpath"]]
    assert joined["caption_file"].to_list() == ["a.txt", "b.txt", None, "sub/c.d.txt"]
    assert joined["caption_size"].to_list() == [stats["a.txt"][0], stats["b.txt"][0], None, stats["sub/c.d.txt"][0]]
    assert joined["size"].to_list()[:2] == [stats["a.png"][0], stats["b.mp4"][0]] and joined["size"][2] is None
    assert orphans == ["sub/c.txt", "z.txt"]
