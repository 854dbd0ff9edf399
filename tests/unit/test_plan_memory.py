"""What keeps the shard plan's memory near its columns at millions of items (#43)."""

from __future__ import annotations

import json

import polars as pl
import pytest

from diffpipe.data.cache import plan, plan_table
from diffpipe.utils import stable_json


def test_shards_are_cut_without_sorting_the_whole_item_table(monkeypatch):
    """Sorting the table by shard copied every column (0.6 KiB per item at 200,000 items): only the shard
    and row-number columns may be sorted, and each shard still comes out in id order."""
    ids = [f"{(i * 7919) % 10007:016x}" for i in range(300)]
    items = pl.DataFrame({"id": ids, "path": [f"/d/{i}.png" for i in ids], "caption": ["c"] * 300}).sort("id")
    items = items.with_columns(plan_table.assign(items["id"], 7, None))
    widths: list[int] = []
    sort = pl.DataFrame.sort
    monkeypatch.setattr(pl.DataFrame, "sort", lambda self, *a, **k: widths.append(self.width) or sort(self, *a, **k))
    out = dict(plan_table.shard_slices(items, 7))
    assert widths and max(widths) <= 2, widths
    for k, rows in out.items():
        mine = items.filter(pl.col("shard") == k).drop("shard")
        assert rows == mine.to_dicts()  # id order within the shard, every column but the shard
    assert sum(map(len, out.values())) == items.height


@pytest.mark.parametrize("ids", [[f"{i:016x}" for i in (900, 3, 77)], ["ab", 'odd"id', "c\\d"]])
def test_the_previous_assignment_is_read_as_a_table_not_a_dict_of_every_item(tmp_path, monkeypatch, ids):
    """``json.loads`` of the state made a Python dict of every item (~280 bytes each): the text
    :func:`plan_table.state_json` writes for hex ids is split in polars; other ids still go through json."""
    shards = [i % 3 for i in range(len(ids))]
    path = tmp_path / "plan-state.json"
    path.write_text(plan_table.state_json(pl.Series(ids, dtype=pl.String), pl.Series(shards), 3) + "\n")
    hex_ids = all(set(i) <= set("0123456789abcdef") for i in ids)
    if hex_ids:
        monkeypatch.setattr(json, "loads", lambda *a, **k: pytest.fail("json.loads of the whole state"))
    table = plan._read_state(path, 3)
    assert isinstance(table, pl.DataFrame)
    assert dict(zip(table["id"], table["shard"], strict=True)) == dict(zip(ids, shards, strict=True))
    assert plan._read_state(path, 4) is None  # another shard count: start over


@pytest.mark.parametrize("text", ["", "{", "[]", '{"assignment":{},"shards":3}', '{"assignment":{"a":"x"},"shards":3}',
                                  stable_json({"assignment": {"ab": 1}, "shards": 3})[:-3]])
def test_a_damaged_or_empty_state_starts_the_assignment_over(tmp_path, text):
    path = tmp_path / "plan-state.json"
    path.write_text(text)
    assert plan._read_state(path, 3) is None
    assert plan._read_state(tmp_path / "missing.json", 3) is None
