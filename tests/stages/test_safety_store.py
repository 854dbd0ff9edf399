"""Issue #14, item 3 (``cache.dir``): no store shard is deleted or replaced while another job reads it.

Cache jobs of several runs share one content-addressed store. A job reads
store shards (reuse) and hard-links its shard into the run; ``cache prune``
and the discard of a damaged shard delete store shards. Each test puts the
second process's move at the worst moment (a real ``prune`` in another
process, started from inside the job's read or link) and checks that it
waits for the job, and that the job's output is complete.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from diffpipe.cache_jobs import cache_latents
from diffpipe.config import load_config
from diffpipe.data.cache import store as store_mod
from diffpipe.data.cache.latents import LatentShard
from diffpipe.data.cache.store import INDEX_SUFFIX, Store, prune
from diffpipe.paths import RunPaths

PRUNE = """
import sys
from diffpipe.data.cache.store import Store, prune
print("start", flush=True)
print("removed " + ",".join(prune(Store(sys.argv[1]), "latents")), flush=True)
"""
# Holds the store's shared lock (as a reading job does) until its stdin closes.
READER = """
import os, sys
from diffpipe.data.cache.store import Store
store = Store(sys.argv[1])
shard = store.shard_path("latents", sys.argv[2])
with store.lock():
    print("locked", flush=True)
    before = os.stat(shard).st_ino
    sys.stdin.read()
    print("still there" if shard.exists() and os.stat(shard).st_ino == before else "gone or replaced", flush=True)
"""


def _start(script: str, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", script, *map(str, args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    assert first.strip() in ("start", "locked"), first + proc.stderr.read()
    return proc


def _still_running(proc: subprocess.Popen, seconds: float = 2.0) -> bool:
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        return True
    return False


@pytest.fixture
def run(tiny_run, tmp_path):
    """A cached tiny run whose store also holds a newer copy of its latent shard.

    ``prune`` removes the older of two shards holding the same keys: the one the
    run's cache job reads and links.
    """
    cfg = load_config(tiny_run.clone(tmp_path))
    paths = RunPaths(cfg.output_dir)
    store = Store(paths.cache_store(cfg.cache.dir))
    [index] = (store.root / "latents").glob(f"*{INDEX_SUFFIX}")
    name = index.name.removesuffix(INDEX_SUFFIX)
    copy = "f" * 32  # sorts last: lookups keep reading the original
    shutil.copytree(store.shard_path("latents", name), store.shard_path("latents", copy))
    shutil.copy2(index, store.index_path("latents", copy))
    os.utime(index, (1, 1))  # older: prune picks it
    shard = paths.shard_names()[0]
    return {"cfg": cfg, "paths": paths, "store": store, "name": name, "shard": shard}


def _cache(run) -> dict:
    p = run["paths"]
    return cache_latents(p.latent_spec(run["shard"]), p.latent_shard(run["shard"]), run["cfg"].model, run["cfg"].cache)


@pytest.mark.parametrize("moment", ["reuse", "link"])
def test_prune_waits_for_a_job_reading_the_store(run, monkeypatch, moment):
    """``cache prune`` started while a cache job reads (reuse) or links a store shard waits for it."""
    waited = []

    def interleave(real):
        def hooked(*args, **kwargs):
            if not waited:  # the first read or link: start prune, give it time to run
                proc = _start(PRUNE, run["store"].root)
                waited.append((proc, _still_running(proc)))
            return real(*args, **kwargs)
        return hooked

    if moment == "reuse":
        monkeypatch.setattr(LatentShard, "load", interleave(LatentShard.load))
    else:  # linking the store shard into the run, file by file
        monkeypatch.setattr(store_mod, "_link_or_copy", interleave(store_mod._link_or_copy))
    summary = _cache(run)
    [(proc, was_waiting)] = waited
    out, err = proc.communicate(timeout=300)
    assert was_waiting, f"prune ran while the job held the store: {out}{err}"
    assert proc.returncode == 0 and f"removed {run['name']}" in out, err
    assert summary["reused"] == summary["items"] and summary["encoded"] == 0  # nothing lost to the race
    assert LatentShard(run["paths"].latent_shard(run["shard"])).verify()  # the run's hard links survive prune


def test_discard_and_prune_wait_for_readers(run):
    """A reader's shared lock: other readers go on, prune and discard wait until it ends."""
    store, name = run["store"], run["name"]
    reader = _start(READER, store.root, name)
    other = _start(READER, store.root, name)  # a second reader is not blocked
    other.stdin.close()
    assert other.wait(120) == 0 and "still there" in other.stdout.read()
    pruner = _start(PRUNE, store.root)
    assert _still_running(pruner)
    reader.stdin.close()
    assert reader.wait(120) == 0 and "still there" in reader.stdout.read()
    out, err = pruner.communicate(timeout=300)
    assert f"removed {name}" in out, err
    assert not store.shard_path("latents", name).exists()


def test_a_damaged_shard_is_discarded_only_when_no_one_reads_it(run):
    """The job re-encodes a damaged store shard's rows; it removes the shard after its readers are done."""
    store, name = run["store"], run["name"]
    # Damage the copy too, and drop it: the job must re-encode.
    shutil.rmtree(store.shard_path("latents", "f" * 32))
    store.index_path("latents", "f" * 32).unlink()
    chunk = next(p for p in store.shard_path("latents", name).rglob("c.*") if p.is_file())
    chunk.write_bytes(b"\0" * len(chunk.read_bytes()))
    reader = _start(READER, store.root, name)
    started = time.monotonic()
    release = threading.Timer(3.0, reader.stdin.close)
    release.start()
    try:
        summary = _cache(run)
    finally:
        release.cancel()
        if not reader.stdin.closed:
            reader.stdin.close()
    assert reader.wait(120) == 0 and "still there" in reader.stdout.read()
    assert time.monotonic() - started >= 3.0  # the job waited for the reader before replacing the shard
    assert summary["encoded"] == summary["items"]
    assert LatentShard(store.shard_path("latents", name)).verify()  # replaced by a good copy
    assert LatentShard(run["paths"].latent_shard(run["shard"])).verify()


def test_prune_clears_leftovers_of_killed_writers(run):
    """Under the exclusive lock every temp folder is a killed writer's: prune removes them and orphans."""
    store = run["store"]
    leftover = store.root / "latents" / f".tmp-{run['name']}.zarr-dead"
    leftover.mkdir()
    orphan = store.shard_path("latents", "0" * 32)  # renamed into place, killed before its index
    shutil.copytree(store.shard_path("latents", run["name"]), orphan)
    prune(store, "latents")
    assert not leftover.exists() and not orphan.exists()
    assert store.has("latents", "f" * 32)  # the newer of the two holders stays
