import os

import torch

from diffpipe.data.cache.latents import LatentEntry, LatentShard, write_latent_shard
from diffpipe.data.cache.store import Store, clean_stale_temp, link_into_place, shard_content_name


def _write(store: Store, name: str, keys: list[str]) -> None:
    entries = [
        LatentEntry(f"id{i}", k, (1, 8, 8), torch.full((4, 1, 1, 1), float(i)))
        for i, k in enumerate(keys)
    ]
    write_latent_shard(store.shard_path("latents", name), entries)
    store.add_index("latents", name, [(k, "1x8x8", i) for i, k in enumerate(keys)])


def test_lookup_add_and_discard(tmp_path):
    store = Store(tmp_path)
    assert store.lookup("latents", ["a"]) == {}
    _write(store, "n1", ["a", "b"])
    _write(store, "n2", ["b", "c"])
    found = store.lookup("latents", ["a", "b", "c", "zz"])
    assert sorted(found) == ["a", "b", "c"] and found["b"].shard.name == "n1.zarr"  # first by name
    assert found["c"].row == 1 and found["c"].array == "1x8x8"
    # A shard without its index is invisible (the index is written last).
    write_latent_shard(store.shard_path("latents", "n3"), [])
    assert not store.has("latents", "n3") and store.has("latents", "n1")
    store.discard("latents", "n1")
    assert store.lookup("latents", ["a", "b"]).keys() == {"b"}
    assert not store.shard_path("latents", "n1").exists()


def test_content_names_and_links(tmp_path):
    assert shard_content_name("latents", "float32", [("i", "k")]) == shard_content_name(
        "latents", "float32", [("i", "k")]
    )
    assert shard_content_name("latents", "float32", [("i", "k")]) != shard_content_name(
        "latents", "bfloat16", [("i", "k")]
    )
    store = Store(tmp_path / "store")
    _write(store, "n1", ["a"])
    src = store.shard_path("latents", "n1")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".tmp-s0.zarr-dead").mkdir()  # a killed writer's leftover
    link_into_place(src, tmp_path / "run" / "s0.zarr")
    assert LatentShard(tmp_path / "run" / "s0.zarr").verify()
    assert (
        os.stat(src / "zarr.json").st_ino
        == os.stat(tmp_path / "run" / "s0.zarr" / "zarr.json").st_ino
    )
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["s0.zarr"]
    (tmp_path / "f").write_text("x")
    link_into_place(tmp_path / "f", tmp_path / "g")
    assert (tmp_path / "g").read_text() == "x"
    clean_stale_temp(tmp_path / "nowhere" / "x")  # a missing folder is fine


def test_shard_assignment_is_sticky_and_groups_new_items():
    from diffpipe.data.cache.plan import assign_shards, shard_index

    ids = [f"{i:016x}" for i in range(0, 4000, 37)]
    first = assign_shards(ids, 4)
    assert first == {i: shard_index(i, 4) for i in ids}
    added = [f"{i:016x}" for i in range(5001, 5011)]
    second = assign_shards(ids + added, 4, first)
    assert {second[i] for i in added} == {
        min(range(4), key=lambda k: (list(first.values()).count(k), k))
    }
    assert all(second[i] == first[i] for i in ids)  # nothing moves
    assert assign_shards(ids[1:], 4, second) == {
        i: first[i] for i in ids[1:]
    }  # a deletion moves nothing
    assert assign_shards(ids, 3, first) == {
        i: shard_index(i, 3) for i in ids
    }  # another count: start over


def test_plan_state_text_is_the_stable_json_of_the_assignment():
    """The plan writes its state from columns, never a dict of every item: the same text as before."""
    import polars as pl

    from diffpipe.data.cache.plan_table import state_json
    from diffpipe.utils import stable_json

    for ids in ([f"{i:016x}" for i in (900, 3, 77)], ["ab", 'odd"id', "c\\d"], []):
        shards = [i % 3 for i in range(len(ids))]
        text = state_json(pl.Series(ids, dtype=pl.String), pl.Series(shards, dtype=pl.Int64), 3)
        assert text == stable_json({"shards": 3, "assignment": dict(zip(ids, shards, strict=True))})


def test_prune_removes_only_superseded_shards(tmp_path):
    from diffpipe.data.cache.store import prune

    store = Store(tmp_path)
    _write(store, "old", ["a", "b"])
    os.utime(store.index_path("latents", "old"), (1, 1))
    _write(store, "new", ["a", "b", "c"])
    _write(store, "other", ["d"])
    link_into_place(store.shard_path("latents", "old"), tmp_path / "run.zarr")
    assert prune(store, "latents") == ["old"]
    assert sorted(store.lookup("latents", ["a", "b", "c", "d"])) == ["a", "b", "c", "d"]
    assert LatentShard(tmp_path / "run.zarr").verify()  # a run's hard links survive
    assert prune(store, "latents") == []
