"""Full training checkpoints: written atomically, kept to the last K, resumed exactly.

A checkpoint is a folder ``train/checkpoints/step-NNNNNN`` holding

- DeepSpeed's own state (trainable weights, optimizer, LR scheduler; the
  frozen base weights are left out),
- ``rng-rankNNN.safetensors``: every random-number state of each rank
  (tensors, plus the Python and NumPy states as JSON in the header),
- ``adapter/``: the LoRA as a PEFT adapter folder (what ``diffpipe export
  --checkpoint`` reads, see ``adapter_from_checkpoint``),
- ``data-items.json``: each training item's cache keys (image and caption),
  so a resume can name what changed in the data,
- ``diffpipe.json``: step, data position, world size, the resolved config and
  the digest of the training items, written last.

Every rank writes into ``.tmp-step-NNNNNN`` and syncs it to disk; rank 0
renames it to its final name only after all ranks are done, so a process
killed (or a machine losing power) while writing leaves a ``.tmp-*`` folder
that nothing reads (and the next save removes), never a half-written
checkpoint (SimpleTuner #2613). Only folders named exactly ``step-NNNNNN``
count as checkpoints: a user's ``step-000012.bak`` is neither read nor pruned.

Nothing is unpickled freely: DeepSpeed's ``.pt`` files are read with
``torch.load(weights_only=True)``, allowing tensors, plain containers and
exactly the few DeepSpeed types they hold (see ``engine.safe_checkpoint_loads``);
a file holding anything else is refused, naming it, and nothing in it runs.
Every rank first checks every file without unpickling it (``check_files``), so
a bad file stops all ranks together with the same message.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from diffpipe.config import ConfigError
from diffpipe.training.adapter import load_adapter
from diffpipe.training.engine import deepspeed_safe_types, safe_checkpoint_loads
from diffpipe.training.finite import check_tensors
from diffpipe.utils import atomic_path, digest, fsync_dir, fsync_tree, write_text_atomic

META_NAME = "diffpipe.json"
ITEMS_NAME = "data-items.json"
ADAPTER_NAME = "adapter"
SAVE_REQUEST = "save"  # an empty file of this name in train/ asks for a checkpoint
_PREFIX = "step-"
_TMP = ".tmp-"
_NAME = re.compile(r"step-(\d+)")  # a checkpoint folder: exactly this (fullmatch)
_TMP_NAME = re.compile(r"\.tmp-step-\d+(\.old)?")  # what save_checkpoint leaves when killed
#: What the legacy ``rng-rankNNN.pt`` files (pickled NumPy state) need under weights_only=True.
_NUMPY_GLOBALS = (np._core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType)

# Config keys a resume may change: they do not alter what the checkpoint means.
RESUME_SAFE_KEYS = (
    "output_dir",
    "validation",
    "export",
    "sample",
    "datasets.*.path",
    "train.checkpoint_every_steps",
    "train.checkpoint_every_minutes",
    "train.keep_checkpoints",
    "train.save_every_epochs",
    "train.eval",
    "train.sample_every_steps",
    "train.sample_every_epochs",
    # What is measured and logged, never what is trained:
    "train.count_flops",
    # When a diverging run stops: no step it trains differs.
    "train.max_nonfinite_steps",
    "train.peak_tflops",
    "train.profile",
    "bench",
    "train.trackers",
    "train.tracker_project",
    "train.run_name",
    # How the memory keys were chosen, never what they are: the config a checkpoint records holds the planned
    # settings themselves (train.memory: auto), so a plan that changed one of them is still refused.
    "train.memory",
    "train.gpu_memory",
)


class ResumeError(ConfigError):
    """A checkpoint cannot be continued with this config or process count."""


class CheckpointError(ValueError):
    """A checkpoint file is damaged, missing, or holds objects diffpipe refuses to unpickle."""


def checkpoint_name(step: int) -> str:
    return f"{_PREFIX}{step:06d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first.

    Only folders named exactly ``step-NNNNNN`` holding a ``diffpipe.json`` count:
    temporary folders and anything else (a user's ``step-000012.bak``) are left alone.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.fullmatch(p.name) and (p / META_NAME).is_file()]
    return sorted(found, key=lambda p: int(p.name.removeprefix(_PREFIX)))


def resolve_checkpoint(root: str | Path, name: str | None = None) -> Path:
    """The checkpoint to resume: the latest under ``root``, or ``name`` (a folder name or path)."""
    root = Path(root)
    if name:
        path = Path(name) if Path(name).is_absolute() or os.sep in name else root / name
        if not (path / META_NAME).is_file():
            have = ", ".join(p.name for p in list_checkpoints(root)) or "none"
            raise FileNotFoundError(f"no complete checkpoint at {path} (complete ones under {root}: {have})")
        return path
    found = list_checkpoints(root)
    if not found:
        raise FileNotFoundError(f"no checkpoint to resume under {root}; train without --resume first")
    return found[-1]


def read_meta(ckpt: str | Path) -> dict[str, Any]:
    """The checkpoint's ``diffpipe.json``; CheckpointError naming it when damaged."""
    ckpt = Path(ckpt)
    try:
        meta = json.loads((ckpt / META_NAME).read_text())
        int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise _damaged(ckpt / META_NAME, ckpt, f"cannot be read ({type(err).__name__}: {err})") from None
    return meta


def _damaged(file: Path, ckpt: Path, problem: str) -> CheckpointError:
    """An error naming ``file``, what is wrong with it, and the way out (another checkpoint)."""
    others = [p.name for p in list_checkpoints(ckpt.parent) if p.name != ckpt.name]
    way = (f"use another one (`diffpipe train --checkpoint {others[-1]}` resumes from it; complete ones: "
           f"{', '.join(others)})" if others else "train again without --resume")
    return CheckpointError(f"{file} {problem}. The checkpoint {ckpt} cannot be used: {way}, or delete {ckpt}.")


def load_torch_file(path: str | Path, ckpt: Path, *, allowed: Iterable[Any] = (), map_location: Any = "cpu") -> Any:
    """``torch.load(weights_only=True)``: tensors, plain containers and exactly the ``allowed`` types.

    A file holding anything else (a crafted pickle) is refused before any of it
    runs; a damaged or missing one gets an error naming it and ``ckpt``'s way out.
    """
    path = Path(path)
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location=_plain_location(map_location), weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL (\S+)", str(err))
        what = f"it would import {found.group(1)}" if found else str(err).splitlines()[-1][:200]
        raise _refused(path, ckpt, what) from None
    except FileNotFoundError:
        raise _damaged(path, ckpt, "is missing") from None
    except Exception as err:  # torch raises RuntimeError, EOFError, ... for a truncated file
        raise _damaged(path, ckpt, f"is damaged or truncated ({type(err).__name__}: {err})") from None


def _plain_location(map_location: Any) -> Any:
    """``"cpu"`` for a callable that leaves CPU storages where they are (DeepSpeed's ``lambda storage, loc:
    storage``): torch cannot rebuild tensor subclasses (torchao's quantised optimizer states) through a callable
    ``map_location``, and ``"cpu"`` loads the same tensors. Anything else as it is."""
    if callable(map_location):
        probe = map_location(torch.UntypedStorage(1), "cpu")
        if isinstance(probe, torch.UntypedStorage | torch.TypedStorage) and probe.device.type == "cpu":
            return "cpu"
    return map_location


def _refused(path: Path, ckpt: Path, what: str) -> CheckpointError:
    return _damaged(path, ckpt, f"holds a pickled object diffpipe refuses to load ({what}); checkpoint files "
                    "hold only tensors and DeepSpeed's own state, so this one was altered or not written by "
                    "diffpipe. Nothing in it was run")


def check_files(ckpt: Path, *, world_size: int, allowed: Iterable[Any] = ()) -> None:
    """Refuse a checkpoint whose ``.pt`` files are damaged or pickle more than ``allowed`` types, or
    whose RNG files (one per rank) do not read; CheckpointError naming the first bad file.

    Cheap (only the pickles are disassembled, no tensor is read, nothing is unpickled) and the
    same on every rank: all ranks refuse together, before any of them waits in a collective
    for one that failed. The loads themselves still go through ``load_torch_file``.
    """
    for path in sorted(ckpt.glob("*.pt")):
        if path.name.startswith("rng-rank"):  # an older diffpipe's RNG file: read_rng checks it below
            continue
        try:
            with torch.serialization.safe_globals(list(allowed)):
                unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception as err:  # not a zip written by torch.save, or truncated
            raise _damaged(path, ckpt, f"is damaged or truncated ({type(err).__name__}: {err})") from None
        if unsafe:
            raise _refused(path, ckpt, f"it would import {sorted(unsafe)[0]}")
    for rank in range(world_size):
        read_rng(ckpt, rank)


# -- random-number state ------------------------------------------------------------
def rng_state(generator: torch.Generator) -> dict[str, Any]:
    """Every RNG a step draws from: the noise generator, torch (LoRA dropout), Python, NumPy."""
    state = {
        "generator": generator.get_state(),
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def rng_file(ckpt: Path, rank: int) -> Path:
    return ckpt / f"rng-rank{rank:03d}.safetensors"


def save_rng(state: dict[str, Any], path: Path) -> None:
    """``rng_state`` as safetensors: the generator states as tensors, Python's and NumPy's as JSON."""
    kind, keys, pos, has_gauss, cached = state["numpy"]
    tensors = {"generator": state["generator"], "torch": state["torch"],
               "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.int64))}
    tensors.update({f"cuda.{i}": s for i, s in enumerate(state.get("cuda", []))})
    version, internal, gauss = state["python"]
    header = {"python": json.dumps([version, list(internal), gauss]),
              "numpy": json.dumps([kind, int(pos), int(has_gauss), float(cached)]),
              "cuda": str(len(state.get("cuda", [])))}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=header)


def read_rng(ckpt: Path, rank: int) -> dict[str, Any]:
    """This rank's RNG states from ``rng-rankNNN.safetensors`` (or an older diffpipe's ``.pt``, read
    with weights_only=True); CheckpointError naming the file when it is missing or damaged."""
    path = rng_file(ckpt, rank)
    legacy = path.with_suffix(".pt")
    if not path.is_file() and legacy.is_file():
        return load_torch_file(legacy, ckpt, allowed=_NUMPY_GLOBALS)
    if not path.is_file():
        raise _damaged(path, ckpt, "is missing")
    try:
        with safe_open(str(path), framework="pt") as f:
            header, t = f.metadata() or {}, {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        version, internal, gauss = json.loads(header["python"])
        kind, pos, has_gauss, cached = json.loads(header["numpy"])
        state = {"generator": t["generator"], "torch": t["torch"], "python": (version, tuple(internal), gauss),
                 "numpy": (kind, t["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached)}
        if int(header["cuda"]):
            state["cuda"] = [t[f"cuda.{i}"] for i in range(int(header["cuda"]))]
    except Exception as err:  # SafetensorError, JSON, missing keys: all mean damaged
        raise _damaged(path, ckpt, f"is damaged or truncated ({type(err).__name__}: {err})") from None
    return state


def set_rng_state(generator: torch.Generator, state: dict[str, Any]) -> None:
    generator.set_state(state["generator"])
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- save ------------------------------------------------------------------------------
def save_checkpoint(
    engine: Any,
    root: str | Path,
    *,
    step: int,
    rank: int,
    meta: dict[str, Any],
    rng: dict[str, Any],
    write_adapter: Callable[[Path], None],
    keep_last: int = 0,
    data_items: dict[str, Any] | None = None,
) -> Path:
    """Write checkpoint ``step-<step>`` atomically and durably (collective: every rank calls it).

    ``write_adapter(folder)`` is called on every rank (ZeRO-3 gathers the
    weights collectively) and writes the adapter on rank 0. ``data_items``
    (``items_digest``'s input) lets a resume name the items that changed.
    Every file is synced before the folder gets its final name, and the rename
    before ``keep_last > 0`` removes all but the newest ``keep_last`` checkpoints.
    """
    root = Path(root)
    name = checkpoint_name(step)
    tmp_tag = _TMP + name
    tmp = root / tmp_tag
    if rank == 0 and root.is_dir():
        for stale in root.iterdir():  # left by a killed run (only names diffpipe gives them)
            if _TMP_NAME.fullmatch(stale.name) and stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    engine.save_checkpoint(str(root), tag=tmp_tag, client_state={"step": step}, save_latest=False,
                           exclude_frozen_parameters=True)
    save_rng(rng, rng_file(tmp, rank))
    write_adapter(tmp / ADAPTER_NAME)
    fsync_tree(tmp, missing_ok=True)  # each rank syncs after its own writes, so every file is synced by its writer
    fault_point("checkpoint-write", step)
    _barrier()
    final = root / name
    if rank == 0:
        if data_items is not None:
            write_text_atomic(tmp / ITEMS_NAME, json.dumps(data_items, sort_keys=True))
        write_text_atomic(tmp / META_NAME, json.dumps({**meta, "step": step}, indent=1, sort_keys=True))
        fsync_tree(tmp)  # the atomic writes synced their files under temporary names; every name is final now
        old = root / f"{tmp_tag}.old"
        if final.exists():  # a newer run over an older resume point: replace it
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(root)  # the rename is on disk before anything older goes
        shutil.rmtree(old, ignore_errors=True)
        if keep_last > 0:
            for stale in list_checkpoints(root)[:-keep_last]:
                shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    return final


# -- resume ----------------------------------------------------------------------------
def load_checkpoint(engine: Any, ckpt: Path, *, rank: int, world_size: int = 1) -> dict[str, Any]:
    """Load DeepSpeed's state into ``engine``, every file with weights_only=True; return this rank's RNG state."""
    allowed = deepspeed_safe_types()
    check_files(ckpt, world_size=world_size, allowed=allowed)

    def load(path: str, map_location: Any = None) -> Any:
        return load_torch_file(path, ckpt, allowed=allowed, map_location=map_location)

    try:
        with safe_checkpoint_loads(engine, load, allowed):
            path, _ = engine.load_checkpoint(str(ckpt.parent), tag=ckpt.name, load_module_strict=False)
    except CheckpointError:
        raise
    except Exception as err:  # a file DeepSpeed reads itself, or missing/mismatched contents
        raise _damaged(ckpt, ckpt, f"cannot be loaded by DeepSpeed ({type(err).__name__}: {err})") from None
    if path is None:
        raise _damaged(ckpt, ckpt, "cannot be loaded by DeepSpeed (no model states found)")
    return read_rng(ckpt, rank)


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        out = {f"{prefix}length": len(value)}
        for i, v in enumerate(value):
            out.update(_flatten(v, f"{prefix}{i}."))
        return out
    return {prefix.rstrip("."): value}


def _safe(key: str) -> bool:
    parts = key.split(".")
    for pattern in RESUME_SAFE_KEYS:
        pat = pattern.split(".")
        if len(parts) >= len(pat) and all(p in ("*", k) for p, k in zip(pat, parts, strict=False)):
            return True
    return False


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Dotted config keys whose values differ and that make a checkpoint meaningless."""
    a, b = _flatten(saved), _flatten(current)
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k, "<unset>") != b.get(k, "<unset>"))
    return [k for k in keys if not _safe(k)]


def items_digest(items: dict[str, dict[str, Any]]) -> str:
    """Digest of what training reads: each item's id, bucket, repeats and cache keys (image, caption).

    Paths are left out (moving a dataset is resume-safe; its ids are relative paths).
    """
    return digest(["data-items-2", [[i, v["bucket"], v["repeats"], v["image"], v["caption"]]
                                    for i, v in sorted(items.items())]])


def _legacy_digest(items: dict[str, dict[str, Any]]) -> str:
    """What checkpoints of older diffpipe versions recorded (ids, paths, buckets, repeats; no content)."""
    return digest([[i, v["path"], v["bucket"], v["repeats"]] for i, v in sorted(items.items())])


_ITEM_CHANGES = (("image changed", ("image",)), ("caption changed", ("caption",)),
                 ("bucket or repeats changed", ("bucket", "repeats")))


def _data_changes(ckpt: Path, items: dict[str, dict[str, Any]] | None, shown: int = 5) -> list[str]:
    """Lines naming the items added, removed or changed since ``ckpt`` (from its ``data-items.json``)."""
    file = ckpt / ITEMS_NAME
    if items is None or not file.is_file():
        return ["  training data: the cached items differ from the checkpoint's (dataset edited?)"]
    try:
        before = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise _damaged(file, ckpt, f"cannot be read ({err})") from None
    changes: dict[str, list[str]] = {}
    for i in sorted(before.keys() | items.keys()):
        old, new = before.get(i), items.get(i)
        kinds = (["added"] if old is None else ["removed"] if new is None else
                 [kind for kind, keys in _ITEM_CHANGES if any(old.get(k) != new.get(k) for k in keys)])
        for kind in kinds:
            changes.setdefault(kind, []).append((new or old)["path"])
    n = len({i for i in before.keys() | items.keys() if before.get(i) != items.get(i)})
    lines = [f"  training data: {n} of {len(items)} items differ from the checkpoint's (the dataset was "
             "edited and cached again; image: the file, its mask or control image; caption: its text):"]
    for kind, paths in changes.items():
        lines += [f"    {kind}: {p}" for p in paths[:shown]]
        lines += [f"    {kind}: ... and {len(paths) - shown} more"] if len(paths) > shown else []
    return lines


def check_resumable(meta: dict[str, Any], *, config: dict[str, Any], world_size: int, data_digest: str,
                    ckpt: Path, data_items: dict[str, dict[str, Any]] | None = None) -> None:
    """Refuse, naming what differs, when the checkpoint does not fit this run.

    ``data_items`` (what ``data_digest`` digests) lets the message name the changed items.
    """
    problems = []
    saved_cfg = meta.get("config", {})
    a, b = _flatten(saved_cfg), _flatten(config)
    for key in config_differences(saved_cfg, config):
        problems.append(f"  {key}: checkpoint {a.get(key, '<unset>')!r}, config {b.get(key, '<unset>')!r}")
    if meta.get("world_size") != world_size:
        problems.append(f"  processes: checkpoint {meta.get('world_size')}, now {world_size}")
    legacy = data_items is not None and meta.get("data_digest") == _legacy_digest(data_items)
    if meta.get("data_digest") != data_digest and not legacy:
        problems += _data_changes(ckpt, data_items)
    if problems:
        raise ResumeError(
            f"cannot resume from {ckpt}: it was made with a different setup:\n" + "\n".join(problems)
            + "\nRestore those settings, or start a new run (another output_dir, or train without --resume)."
        )


def truncate_metrics(jsonl: Path, step: int) -> None:
    """Drop metric rows after ``step`` (a killed run may have logged past its last checkpoint)."""
    if not jsonl.exists():
        return
    keep = [line for line in jsonl.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step]
    write_text_atomic(jsonl, "".join(line + "\n" for line in keep))


# -- export ----------------------------------------------------------------------------
def adapter_from_checkpoint(ckpt_dir: str | Path, out_adapter_dir: str | Path) -> Path:
    """Copy the LoRA of a training checkpoint out as a PEFT adapter folder.

    ``ckpt_dir`` is a checkpoint folder (``.../checkpoints/step-000100``) or a
    run's ``checkpoints`` folder (then its latest checkpoint is used). The
    result is what ``train/adapter`` holds, so every exporter reads it.
    """
    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / META_NAME).is_file() and list_checkpoints(ckpt_dir):
        ckpt_dir = list_checkpoints(ckpt_dir)[-1]
    src = ckpt_dir / ADAPTER_NAME
    if (ckpt_dir / META_NAME).is_file() and read_meta(ckpt_dir).get("config", {}).get("train", {}).get("mode") == "full":
        raise ValueError(f"{ckpt_dir} is a full fine-tune checkpoint: it holds no LoRA")
    if not (ckpt_dir / META_NAME).is_file() or not src.is_dir():
        raise FileNotFoundError(f"{ckpt_dir} is not a complete diffpipe checkpoint (no {META_NAME} or {ADAPTER_NAME}/)")
    try:
        weights, _ = load_adapter(src)  # fails early on a damaged adapter
    except Exception as err:  # SafetensorError, JSON, PEFT's config errors
        raise _damaged(src, ckpt_dir, f"is damaged ({type(err).__name__}: {err})") from None
    check_tensors(weights, src, what="export")  # a diverged LoRA is refused before any copy of it is written
    with atomic_path(out_adapter_dir, is_dir=True) as tmp:
        for f in src.iterdir():
            shutil.copy2(f, tmp / f.name)
    return Path(out_adapter_dir)


# -- helpers ---------------------------------------------------------------------------
def _barrier() -> None:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def fault_point(point: str, step: int) -> None:
    """Test hook: ``DIFFPIPE_FAULT=<point>:<step>`` kills the process here (e.g. mid-checkpoint).

    ``<point>:<step>:hang`` parks it here instead, until a signal ends it (the interrupt tests).
    """
    fault = os.environ.get("DIFFPIPE_FAULT")
    if fault == f"{point}:{step}":
        os._exit(17)
    while fault == f"{point}:{step}:hang":
        time.sleep(1)
