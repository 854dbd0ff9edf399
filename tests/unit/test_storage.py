import numpy as np
import pyarrow as pa
import pytest
import torch
import zarr

from diffpipe.data.cache.latents import LatentEntry, LatentShard, write_latent_shard
from diffpipe.data.cache.text import TextShard, write_text_shard


def _entries(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    square = [
        LatentEntry(f"id{i:02d}", f"key{i}", (1, 64, 64), torch.randn(4, 1, 8, 8, generator=g))
        for i in range(n)
    ]
    wide = [LatentEntry("zz", "keyz", (1, 48, 88), torch.randn(4, 1, 6, 11, generator=g))]
    return square + wide


def _leftovers(folder):
    return [p.name for p in folder.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_latent_round_trip_is_exact(tmp_path, dtype):
    entries = _entries()
    counts = write_latent_shard(
        tmp_path / "s.zarr", reversed(entries), dtype=dtype, attrs={"identity": "v"}
    )
    assert counts == {"1x64x64": 5, "1x48x88": 1}
    shard = LatentShard(tmp_path / "s.zarr")
    assert shard.verify() and shard.attrs["identity"] == "v" and shard.dtype == dtype
    assert shard.meta["1x64x64"]["ids"] == [f"id{i:02d}" for i in range(5)]  # sorted by id
    assert shard.meta["1x64x64"]["keys"] == [f"key{i}" for i in range(5)]
    got = shard.read("1x64x64")
    want = torch.stack([e.latents for e in entries[:5]])
    if dtype == "bfloat16":
        want = want.to(torch.bfloat16).float()  # exactly the representable values
        raw = shard.read_raw("1x64x64")
        assert raw.dtype == np.uint16 and shard.group["1x64x64"].attrs["dtype"] == "bfloat16"
    assert got.dtype == np.float32 and np.array_equal(got, want.numpy())
    assert shard.shape("1x48x88") == (1, 4, 1, 6, 11)


def test_latent_chunks_hold_row_blocks(tmp_path):
    write_latent_shard(tmp_path / "s.zarr", _entries(20))
    arr = zarr.open_group(str(tmp_path / "s.zarr"), mode="r")["1x64x64"]
    assert arr.chunks == (20, 4, 1, 8, 8)  # the whole bucket in one read


def test_latent_checksum_catches_a_flipped_byte(tmp_path):
    path = tmp_path / "s.zarr"
    write_latent_shard(path, _entries())
    chunk = next(p for p in (path / "1x64x64").rglob("*") if p.is_file() and p.name != "zarr.json")
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x01
    chunk.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"s\.zarr is corrupt"):
        LatentShard(path).verify()


def test_latent_empty_shard_and_missing_shard(tmp_path):
    write_latent_shard(tmp_path / "e.zarr", [])
    shard = LatentShard(tmp_path / "e.zarr")
    assert shard.names == [] and shard.verify()
    with pytest.raises(ValueError, match=r"nope\.zarr is missing"):
        LatentShard(tmp_path / "nope.zarr")


def test_latent_write_failure_leaves_no_shard(tmp_path, monkeypatch):
    path = tmp_path / "s.zarr"
    write_latent_shard(path, _entries(2))
    before = LatentShard(path).read("1x64x64")
    calls = []
    original = zarr.Group.create_array

    def flaky(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the first array is already written
            raise RuntimeError("disk full")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(zarr.Group, "create_array", flaky)
    with pytest.raises(RuntimeError, match="disk full"):
        write_latent_shard(path, _entries(5, seed=1))  # replacing an existing shard
    calls.clear()
    with pytest.raises(RuntimeError, match="disk full"):
        write_latent_shard(tmp_path / "new.zarr", _entries(5))  # a fresh shard
    monkeypatch.undo()
    assert np.array_equal(LatentShard(path).read("1x64x64"), before)  # old shard intact
    assert not (tmp_path / "new.zarr").exists() and _leftovers(tmp_path) == []


def _embeds(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "prompt_embeds": torch.randn(n, 7, 4, generator=g),
        "pooled": torch.randn(n, 4, generator=g),
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_text_round_trip_is_exact(tmp_path, dtype):
    emb = _embeds(3)
    write_text_shard(tmp_path / "t.arrow", ["a", "b", "c"], ["ka", "kb", "kc"], emb, dtype=dtype)
    shard = TextShard(tmp_path / "t.arrow")
    assert shard.ids == ["a", "b", "c"] and shard.keys == ["ka", "kb", "kc"]
    assert shard.shapes == {"prompt_embeds": (7, 4), "pooled": (4,)} and shard.verify()
    field = shard.table.schema.field("prompt_embeds")
    assert pa.types.is_fixed_size_list(field.type)
    assert field.type.value_type == (pa.uint16() if dtype == "bfloat16" else pa.float32())
    for name, t in emb.items():
        want = t.to(torch.bfloat16).float() if dtype == "bfloat16" else t
        assert np.array_equal(shard.read(name), want.numpy())
        assert torch.equal(shard.tensors()[name].float(), want)


def test_text_checksum_catches_a_flipped_byte(tmp_path):
    path = tmp_path / "t.arrow"
    emb = {"prompt_embeds": torch.full((2, 8), 1.5)}
    write_text_shard(path, ["a", "b"], ["ka", "kb"], emb)
    data = bytearray(path.read_bytes())
    pos = data.find(np.float32(1.5).tobytes() * 16)  # the embedding buffer
    assert pos > 0
    data[pos + 5] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"t\.arrow is corrupt"):
        TextShard(path).verify()


def test_text_empty_shard_and_bad_input(tmp_path):
    write_text_shard(tmp_path / "e.arrow", [], [], {})
    shard = TextShard(tmp_path / "e.arrow")
    assert len(shard) == 0 and shard.tensors() == {}
    with pytest.raises(ValueError, match="rows for 2 ids"):
        write_text_shard(tmp_path / "x.arrow", ["a", "b"], ["k", "k"], _embeds(3))
    with pytest.raises(ValueError, match=r"x\.arrow is missing"):
        TextShard(tmp_path / "x.arrow")
    (tmp_path / "junk.arrow").write_bytes(b"not arrow")
    with pytest.raises(ValueError, match=r"junk\.arrow cannot be read"):
        TextShard(tmp_path / "junk.arrow")


def test_text_write_failure_leaves_no_shard(tmp_path, monkeypatch):
    def boom(self, table):
        raise RuntimeError("killed")

    monkeypatch.setattr(pa.ipc.RecordBatchFileWriter, "write_table", boom)
    with pytest.raises(RuntimeError, match="killed"):
        write_text_shard(tmp_path / "t.arrow", ["a"], ["k"], _embeds(1))
    assert list(tmp_path.iterdir()) == []
