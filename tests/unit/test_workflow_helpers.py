import json
import os

import pytest

from diffpipe import workflow as dw
from diffpipe.config import parse_config
from diffpipe.training.engine import deepspeed_config


def _cfg(tmp_path, **over):
    data = {"output_dir": str(tmp_path / "out"), "datasets": [{"name": "d", "path": str(tmp_path / "data")}], **over}
    return parse_config(data)


def test_stage_digest_tracks_only_the_stage_inputs(tmp_path):
    a = _cfg(tmp_path)
    b = _cfg(tmp_path, sample={"prompts": ["something else"]})
    assert dw.stage_digest(a, "sample") != dw.stage_digest(b, "sample")
    for stage in ("validate", "plan", "cache", "train", "export"):
        assert dw.stage_digest(a, stage) == dw.stage_digest(b, stage), stage
    c = _cfg(tmp_path, train={"lr": 0.5})
    assert dw.stage_digest(a, "train") != dw.stage_digest(c, "train")
    assert dw.stage_digest(a, "cache") == dw.stage_digest(c, "cache")


def test_resolved_config_rewritten_only_on_change(tmp_path):
    cfg = _cfg(tmp_path)
    path = dw.write_resolved_config(cfg)
    os.utime(path, (1, 1))
    dw.write_resolved_config(cfg)
    assert os.stat(path).st_mtime == 1
    dw.write_resolved_config(_cfg(tmp_path, train={"lr": 0.5}))
    assert os.stat(path).st_mtime > 1


def test_missing_dataset_folder_is_named(tmp_path):
    cfg = parse_config({"datasets": [{"name": "d", "path": str(tmp_path / "nope")}]})
    with pytest.raises(FileNotFoundError, match=r"datasets\[d\]\.path"):
        dw.dataset_fingerprint(cfg)


def test_dataset_fingerprint_changes_only_with_the_files(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.png").write_bytes(b"x")
    (data / "a.txt").write_text("a cat")
    cfg = _cfg(tmp_path, datasets=[{"name": "d", "path": str(data)}])
    path = dw.dataset_fingerprint(cfg)
    first = open(path).read()
    os.utime(path, (1, 1))
    assert dw.dataset_fingerprint(cfg) == path and os.stat(path).st_mtime == 1  # unchanged: not rewritten
    (data / "a.txt").write_text("a black cat")  # edit
    second = open(dw.dataset_fingerprint(cfg)).read()
    assert second != first
    (data / "b.png").write_bytes(b"y")  # addition
    assert open(dw.dataset_fingerprint(cfg)).read() != second


def test_deepspeed_config_from_ours(tmp_path):
    tc = _cfg(tmp_path, train={"batch_size": 3, "grad_accum": 2, "precision": "bf16", "zero_stage": 2,
                               "grad_clip": 0}).train
    ds = deepspeed_config(tc, world_size=4)
    assert ds["train_batch_size"] == 3 * 2 * 4
    assert ds["bf16"] == {"enabled": True}
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["gradient_clipping"] == 0  # written even at 0: DeepSpeed clips at 1.0 when the key is missing


def _parquet_files(data, n):
    import pyarrow as pa
    import pyarrow.parquet as pq

    for i in range(n):
        pq.write_table(pa.table({"image": [b"x" * (i + 1)], "text": ["a cat"]}), data / f"{i:02d}.parquet")


@pytest.mark.parametrize("layout", ["files", "parquet"])
def test_a_changed_file_changes_only_its_validation_shards_fingerprint(tmp_path, layout):
    """A folder's media file, or a table dataset's Parquet file: only its validation shard's listing changes."""
    from diffpipe.data.dataset.discover import vshard_names, vshard_of
    from diffpipe.paths import RunPaths

    data = tmp_path / "data"
    data.mkdir()
    ext = "png" if layout == "files" else "parquet"
    if layout == "files":
        for i in range(12):
            (data / f"{i:02d}.png").write_bytes(b"x")
    else:
        _parquet_files(data, 12)
    cfg = _cfg(tmp_path, datasets=[{"name": "d", "path": str(data)}], validation={"shards": 3})
    dw.dataset_fingerprint(cfg)
    listings = [RunPaths(cfg.output_dir).validate_listing(n) for n in vshard_names(3)]
    before = [p.read_text() for p in listings]
    assert sum(len(json.loads(text)["files"]) for text in before) == 12
    (data / f"05.{ext}").write_bytes(b"yy")  # new size
    if layout == "files":
        (data / "05.txt").write_text("a cat")  # a caption: the merging job's, no shard's
    dw.dataset_fingerprint(cfg)
    changed = [i for i, p in enumerate(listings) if p.read_text() != before[i]]
    assert changed == [vshard_of("d", f"05.{ext}", 3)]
    assert dw.validation_probes(cfg) == [str(tmp_path / "out" / f"validate/probe/{n}.parquet")
                                         for n in ("v0000", "v0001", "v0002")]
    assert dw.validation_probes(_cfg(tmp_path)) == []  # shards: 1, one job


def test_validation_shard_jobs_take_their_files_from_the_workflow_listing(tmp_path, monkeypatch):
    """#43: each of N validation shard jobs listed and stat-ed the whole dataset to keep its 1/N of it (at a
    million files and 100 shards: 100 walks of two million files). The Snakefile's one listing writes each
    shard's files, with size and mtime, where its job reads them."""
    from diffpipe import stages
    from diffpipe.data.dataset import vshards
    from diffpipe.data.dataset.demo import write_demo_dataset
    from diffpipe.data.dataset.discover import vshard_names, vshard_of
    from diffpipe.paths import RunPaths

    write_demo_dataset(tmp_path / "data", n=6, size=32)
    cfg = _cfg(tmp_path, validation={"shards": 3})
    dw.dataset_fingerprint(cfg)

    def walk(*args, **kwargs):
        raise AssertionError("a validation shard job listed the dataset folder")

    monkeypatch.setattr(vshards, "list_dataset", walk)
    results = {n: stages.validate_shard(cfg, RunPaths(cfg.output_dir), n, workers=1) for n in vshard_names(3)}
    homes = [vshard_of("d", f"shape_{i:03d}.png", 3) for i in range(6)]
    assert [r.probed for r in results.values()] == [homes.count(i) for i in range(3)]
    # A listing written for another shard count, or another dataset folder, is not this job's: it lists itself.
    listing = RunPaths(cfg.output_dir).validate_listing("v0000")
    assert vshards.read_listing(listing, cfg.datasets, "v0000", 2) is None
    moved = _cfg(tmp_path, datasets=[{"name": "d", "path": str(tmp_path / "elsewhere")}]).datasets
    assert vshards.read_listing(listing, moved, "v0000", 3) is None
    # Nor one naming a file outside the dataset folder.
    data = json.loads(listing.read_text())
    data["files"].append(["d", "../secret.png", "image", 1, 1])
    listing.write_text(json.dumps(data))
    assert vshards.read_listing(listing, cfg.datasets, "v0000", 3) is None
