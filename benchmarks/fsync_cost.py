"""What syncing trusted writes costs: each write with ``fsync`` against the same write without it.

Usage (figures in docs/benchmarks.md, "Benchmarks"):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fsync_cost.py [--repeat 15] [--dir /tmp]

Every trusted output goes through ``diffpipe.utils.atomic_path``, which syncs
the new file (every file of a new folder) before its rename and the folder
after it. The "no sync" arm runs the very same code with ``os.fsync``
replaced by a no-op, so the difference is the syncing alone. The two arms
alternate in one process, on one disk (``--dir``), and the table shows the
median of ``--repeat`` runs of each:

- a latent shard published into the store (Zarr folder, its index, the hard
  links into the run: one cache job's write), 256 SD-sized latents (4x64x64 bf16);
- a text shard (Arrow file + index + link), 256 CLIP-sized embeddings (77x768 bf16);
- the manifest (Parquet, 10,000 rows), written as the validate step does;
- a shard spec (JSON, 500 items), written as the plan step does;
- a LoRA adapter folder (PEFT, rank 16, about 1.6M parameters), as training
  and ``import-lora`` write it.

The ratio is what a job's write phase costs with syncing over without, ``+ms``
the time syncing adds; a cache job's encoding and a training run's steps are
not in it (they dwarf these writes). Small writes have high ratios and small
``+ms``: each ``fsync`` waits for the disk (a journal commit) however little it flushes. Figures depend on the disk: a laptop SSD, a network file
system and a VM's virtual disk differ by orders of magnitude.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from diffpipe.data.cache.latents import LatentEntry, write_latent_shard
from diffpipe.data.cache.store import Store
from diffpipe.data.cache.text import write_text_shard
from diffpipe.utils import atomic_path, stable_json, write_if_changed

N_ITEMS = 256


@contextmanager
def no_sync():
    """``os.fsync`` as a no-op: the same writes, nothing forced to the disk."""
    real = os.fsync
    os.fsync = lambda fd: None
    try:
        yield
    finally:
        os.fsync = real


class Counted:
    """Counts ``os.fsync`` calls (the sync arm's own cost driver)."""

    def __init__(self):
        self.calls = 0
        self._real = os.fsync

    @contextmanager
    def __call__(self):
        def counting(fd):
            self.calls += 1
            return self._real(fd)

        os.fsync = counting
        try:
            yield
        finally:
            os.fsync = self._real


def latent_case(root: Path) -> tuple[Callable[[int], None], int]:
    store = Store(root / "store")
    entries = [LatentEntry(f"id{i:04d}", f"k{i:04d}", (1, 512, 512), torch.randn(4, 1, 64, 64))
               for i in range(N_ITEMS)]
    rows = [(e.key, "1x512x512", i) for i, e in enumerate(entries)]

    def run(i: int) -> None:
        store.publish("latents", f"n{i:06d}", root / "run" / f"s{i:06d}.zarr",
                      lambda path: write_latent_shard(path, entries, dtype="bfloat16"), rows)

    return run, N_ITEMS * 4 * 64 * 64 * 2


def text_case(root: Path) -> tuple[Callable[[int], None], int]:
    store = Store(root / "store")
    ids, keys = [f"id{i:04d}" for i in range(N_ITEMS)], [f"k{i:04d}" for i in range(N_ITEMS)]
    emb = {"prompt_embeds": torch.randn(N_ITEMS, 77, 768)}
    rows = [(k, "", r) for r, k in enumerate(keys)]

    def run(i: int) -> None:
        store.publish("text", f"n{i:06d}", root / "run" / f"s{i:06d}.arrow",
                      lambda path: write_text_shard(path, ids, keys, emb, dtype="bfloat16"), rows)

    return run, N_ITEMS * 77 * 768 * 2


def manifest_case(root: Path) -> tuple[Callable[[int], None], int]:
    n = 10_000
    table = pa.table({
        "id": [f"{i:016x}" for i in range(n)],
        "path": [f"/data/set/part{i // 1000:03d}/img_{i:06d}.png" for i in range(n)],
        "sha256": [f"{i:064x}" for i in range(n)],
        "width": list(range(n)), "height": list(range(n)),
        "caption": [f"a red circle on a blue background, number {i}" for i in range(n)],
    })
    size = []

    def run(i: int) -> None:
        path = root / "validate" / f"manifest-{i:06d}.parquet"
        with atomic_path(path) as tmp:
            pq.write_table(table, tmp)
        if not size:
            size.append(path.stat().st_size)

    run(-1)
    return run, size[0]


def spec_case(root: Path) -> tuple[Callable[[int], None], int]:
    items = [{"id": f"{i:016x}", "key": f"{i:064x}", "path": f"/data/img_{i:06d}.png", "bucket": [1, 512, 512],
              "sha256": f"{i:064x}", "crop": [0.5, 0.5], "flip": False} for i in range(500)]

    def run(i: int) -> None:
        write_if_changed(root / "plan" / f"s{i:06d}.json", stable_json({"shard": i, "items": items}))

    return run, len(stable_json({"shard": 0, "items": items}))


def adapter_case(root: Path) -> tuple[Callable[[int], None], int]:
    import peft

    from diffpipe.training.adapter import save_adapter

    sd = {f"blocks.{b}.{m}.lora_{ab}.weight": torch.randn(16, 640) for b in range(20) for m in ("to_q", "to_k",
          "to_v", "to_out.0") for ab in ("A", "B")}
    cfg = peft.LoraConfig(r=16, lora_alpha=16, target_modules=["to_q", "to_k", "to_v", "to_out.0"])

    def run(i: int) -> None:
        save_adapter(root / "adapters" / f"a{i:06d}", sd, cfg, {"step": i})

    return run, sum(t.numel() * 4 for t in sd.values())


CASES = {
    "latent shard -> store + run": latent_case,
    "text shard -> store + run": text_case,
    "manifest (Parquet)": manifest_case,
    "shard spec (JSON)": spec_case,
    "LoRA adapter folder": adapter_case,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()),
                    help="Disk to measure: a fresh folder is made inside it and removed afterwards.")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="diffpipe-fsync-bench-", dir=args.dir))  # ours alone to delete
    print(f"{'write':30} {'size':>9} {'no sync ms':>11} {'sync ms':>9} {'+ms':>6} {'ratio':>6} {'fsyncs':>7}")
    for label, make in CASES.items():
        root = work / label.split()[0]
        run, size = make(root)
        plain, synced, counter, i = [], [], Counted(), 0
        for _ in range(args.repeat):  # alternate the arms: drift hits both alike
            for arm, times in ((no_sync, plain), (counter, synced)):
                t = time.perf_counter()
                with arm():
                    run(i)
                times.append(time.perf_counter() - t)
                i += 1
        a, b = statistics.median(plain) * 1e3, statistics.median(synced) * 1e3
        print(f"{label:30} {size / 2**20:7.2f}MB {a:11.1f} {b:9.1f} {b - a:6.1f} {b / a:6.2f} "
              f"{counter.calls // args.repeat:7d}")
        shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
