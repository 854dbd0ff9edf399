"""One bench point in its own process: ``python -m diffpipe.bench.point SPEC.json``.

It trains through ``diffpipe.training.loop.train`` (the code ``diffpipe
train`` runs) with the point's config, on synthetic batches or the run's
caches, and writes ``status.json`` beside the spec: ``ok``, ``oom`` (CUDA out
of memory, or a failed CPU allocation under the sweep's memory cap) or
``error`` with the message. The step times and memory are in the point's
``train/metrics.jsonl``. Exit code 0 ok, 3 oom, 1 error.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

from diffpipe.paths import RunPaths
from diffpipe.resolve import parse_config

#: Messages of a failed CPU allocation (torch's allocator raises RuntimeError, NumPy and Python MemoryError).
_CPU_OOM = ("can't allocate memory", "cannot allocate memory", "defaultcpuallocator")


def is_oom(err: BaseException) -> bool:
    """CUDA out of memory, or an allocation the process's memory cap refused."""
    if isinstance(err, MemoryError):
        return True
    name = type(err).__name__
    return name == "OutOfMemoryError" or (isinstance(err, RuntimeError) and any(m in str(err).lower() for m in _CPU_OOM))


def run(spec_file: Path) -> int:
    spec = json.loads(spec_file.read_text())
    status = spec_file.parent / "status.json"
    try:
        # deferred into the try: a failing import (a broken torch or DeepSpeed install) is reported in
        # status.json as this point's error, like any other failure
        from diffpipe.training.loop import train

        cfg = parse_config(spec["config"], str(spec_file))
        if spec["data"] == "synthetic":
            from diffpipe.bench.synthetic import synthetic_dataset  # deferred: as train, into the try

            data = synthetic_dataset(Path(spec["inputs"]), cfg.train.batch_size * cfg.train.grad_accum)
        else:
            from diffpipe.data.cache.reader import CachedDataset  # deferred: as train, into the try

            data = CachedDataset.from_run(RunPaths(spec["cache_run"]))
        from diffpipe.train_job import read_base_loras  # deferred: as train, into the try

        read_base_loras(cfg, RunPaths(cfg.output_dir), print)  # model.base_loras, as the train job reads them
        train(cfg, RunPaths(cfg.output_dir), data=data, log=print)
    except BaseException as err:  # noqa: BLE001  (every failure is reported to the sweep)
        oom = is_oom(err)
        status.write_text(json.dumps({"status": "oom" if oom else "error", "error": f"{type(err).__name__}: {err}"}))
        if not oom:
            traceback.print_exc()
        return 3 if oom else 1
    status.write_text(json.dumps({"status": "ok"}))
    return 0


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1])))
