"""Media cells of Parquet tables (diffpipe/data/dataset/tables.py): a cell of a large row group is read
batch by batch, not by reading the whole group, and reads the same bytes as the whole group would."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from diffpipe.data.dataset import tables
from diffpipe.data.dataset.tables import read_media

_MEDIA = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def _write(path, rows: int, size: int, *, group: int, small_pages: bool) -> list[bytes]:
    """A table of random media cells; ``small_pages``: many data pages per group, as the ``datasets`` library
    writes media, else pyarrow's defaults (one dictionary page for a group of large values)."""
    cells = [os.urandom(size) for _ in range(rows)]
    column = pa.array([{"bytes": b, "path": f"{i}.png"} for i, b in enumerate(cells)], type=_MEDIA)
    pq.write_table(pa.table({"image": column, "text": [f"caption {i}" for i in range(rows)]}), path,
                   row_group_size=group, **({"write_batch_size": 4} if small_pages else {}))
    return cells


@pytest.mark.parametrize("small_pages", [True, False])
def test_streamed_cells_are_the_cells(tmp_path, monkeypatch, small_pages):
    monkeypatch.setattr(tables, "WHOLE_GROUP_BYTES", 0)  # every group streamed, in batches of 3 rows
    monkeypatch.setattr(tables, "STREAM_BATCH_BYTES", 3 * 1000)
    path = tmp_path / "t.parquet"
    cells = _write(path, 20, 1000, group=10, small_pages=small_pages)
    for row in (3, 4, 9, 15, 2, 19, 0, 0, 10):  # forward, across groups, backward, the same row again
        assert read_media(f"parquet:{path}#row={row}&column=image") == cells[row]
    with pytest.raises(OSError, match="has 20 rows, no row 20"):
        read_media(f"parquet:{path}#row=20&column=image")


_PEAK = """
import json, sys, pyarrow as pa
from diffpipe.data.dataset.tables import read_media
data = read_media(sys.argv[1])
print(json.dumps({"bytes": len(data), "arrow_peak": pa.default_memory_pool().max_memory()}))
"""


def test_one_cell_of_a_large_row_group_does_not_read_the_group(tmp_path):
    """48 MB of media in one row group: reading one cell allocates a few batches (8 MB each) at most, less
    than the group holds (reading the group whole allocated about twice what it holds: 102 MB)."""
    path = tmp_path / "big.parquet"
    _write(path, 120, 400_000, group=120, small_pages=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", _PEAK, f"parquet:{path}#row=60&column=image"], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout)
    assert got["bytes"] == 400_000
    assert got["arrow_peak"] < 48e6, f"{got['arrow_peak'] / 1e6:.0f} MB allocated for one 0.4 MB cell"


@pytest.mark.parametrize(("text", "says"), [("[1, 2]", r"holds no JSON object \(a list\)"),
                                             ("{broken", "cannot be read as JSON")])
def test_a_saved_datasets_json_that_is_no_object_is_an_error_naming_the_file(tmp_path, text, says):
    from diffpipe.data.dataset.tables import TableError, find_tables

    (tmp_path / "dataset_dict.json").write_text(text)
    with pytest.raises(TableError, match=rf"dataset_dict.json {says}.*; the datasets library writes it"):
        find_tables(tmp_path, "train", parquet=False)
