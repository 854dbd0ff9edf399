"""Hostile and damaged checkpoints and caches (issue #14, items 4, 5, 13, 14).

One 3-step ZeRO-1 run (a checkpoint after every step, so DeepSpeed writes model
and optimizer state files) is trained once, under a spy that logs every
``fsync``, rename and folder removal; each test works on a copy of it.

- Nothing executed: a pickle whose ``__reduce__`` would create a marker folder,
  planted in the RNG file, DeepSpeed's model states or its optimizer states, is
  refused by ``train --resume`` (and by ``export`` for a bare DeepSpeed
  checkpoint) with an error naming the file; the marker never appears.
- Durable: every file and folder of a checkpoint is synced before it gets its
  final name, and the rename is synced before older checkpoints are pruned.
- Resume sees the data's content: an edited caption or image is refused, naming both.
- Damage gets a message naming the file and what to do: a truncated checkpoint
  file, a damaged per-array ``zarr.json``; stray folders next to the
  checkpoints neither block ``--resume`` nor get deleted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from stage_cli import in_process

from diffpipe.paths import RunPaths
from diffpipe.training import checkpoint as ckpts

TRAIN = {"max_steps": 3, "checkpoint_every_steps": 1, "keep_checkpoints": 2, "zero_stage": 1,
         "eval": {"quantiles": []}}

# Runs `diffpipe ARGS` with os.fsync, os.replace and shutil.rmtree wrapped to log their
# paths (to $SPY_LOG at exit); each still does its real work. Power loss cannot be
# produced here, so the test checks the order of syncs and renames instead.
SPY = """
import atexit, json, os, shutil
log, real = [], (os.fsync, os.replace, shutil.rmtree)
def fsync(fd):
    log.append(["fsync", os.readlink(f"/proc/self/fd/{fd}")])
    return real[0](fd)
def replace(src, dst, *a, **k):
    log.append(["replace", os.path.realpath(src), os.path.realpath(dst)])
    return real[1](src, dst, *a, **k)
def rmtree(path, *a, **k):
    log.append(["rmtree", os.path.realpath(path)])
    return real[2](path, *a, **k)
os.fsync, os.replace, shutil.rmtree = fsync, replace, rmtree
atexit.register(lambda: open(os.environ["SPY_LOG"], "w").write(json.dumps(log)))
from diffpipe.cli import main
main()
"""


class _Payload:
    """Unpickling this runs ``os.makedirs(marker)``: what a crafted checkpoint could do."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


@pytest.fixture(scope="module")
def trained(tiny_run, tmp_path_factory) -> Path:
    """The reference run's folder: ``config.yaml`` + ``run/`` + ``spy.json``, and its own dataset copy."""
    root = tmp_path_factory.mktemp("safety-ckpt")
    cfg = tiny_run.clone(root, **TRAIN)
    shutil.copytree(tiny_run.root / "data", root / "data")  # edited (and restored) by one test
    config = yaml.safe_load(cfg.read_text())
    config["datasets"][0]["path"] = str(root / "data")
    cfg.write_text(yaml.safe_dump(config))
    _recache(cfg)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPY_LOG": str(root / "spy.json")}
    result = subprocess.run([sys.executable, "-c", SPY, "train", "-c", str(cfg)], env=env, capture_output=True,
                            text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def _fork(trained: Path, dest: Path, **train) -> tuple[Path, RunPaths]:
    """A copy of the trained run at ``dest`` (output_dir and resume-safe ``train`` keys may differ)."""
    shutil.copytree(trained / "run", dest / "run")
    data = yaml.safe_load((trained / "config.yaml").read_text())
    data["output_dir"] = str(dest / "run")
    data["train"].update(train)
    cfg = dest / "config.yaml"
    cfg.write_text(yaml.safe_dump(data))
    return cfg, RunPaths(dest / "run")


def _run(*args: str) -> tuple[int, str]:
    """Exit code and output of ``diffpipe ARGS`` in this process (no interpreter start-up per refusal)."""
    result = in_process(*args)
    return result.returncode, result.stdout + result.stderr


# -- item 4: durability --------------------------------------------------------------
def test_checkpoint_synced_before_it_is_complete_and_before_pruning(trained):
    log = json.loads((trained / "spy.json").read_text())
    paths = RunPaths(trained / "run")
    root = os.path.realpath(paths.checkpoints)
    assert [c.name for c in ckpts.list_checkpoints(paths.checkpoints)] == ["step-000002", "step-000003"]
    for step in (1, 2, 3):
        name = f"step-{step:06d}"
        tmp, final = os.path.join(root, ".tmp-" + name), os.path.join(root, name)
        done = log.index(["replace", tmp, final])  # the moment it becomes a complete checkpoint
        synced = {entry[1] for entry in log[:done] if entry[0] == "fsync"}
        if step > 1:  # step 1 is pruned by now; its files were the same kinds
            want = {os.path.join(tmp, os.path.relpath(p, final)) for p in [final, *map(str, Path(final).rglob("*"))]}
            want = {os.path.normpath(p) for p in want}
            assert want <= synced, sorted(want - synced)
        # The rename is made durable (the checkpoints folder synced) before anything is pruned.
        later = log[done + 1:]
        dir_sync = later.index(["fsync", root])
        prunes = [i for i, entry in enumerate(later) if entry[0] == "rmtree" and entry[1].startswith(root + os.sep)
                  and not entry[1].startswith(os.path.join(root, ".tmp-"))]
        assert all(i > dir_sync for i in prunes), (step, later[: dir_sync + 1])
    assert ["rmtree", os.path.join(root, "step-000001")] in log  # keep_checkpoints: 2 pruned it


# -- item 5: no pickle runs ------------------------------------------------------------
def _plant(file: Path, marker: Path) -> None:
    torch.save({"module": _Payload(marker), "optimizer_state_dict": _Payload(marker)}, file)


@pytest.mark.parametrize("target", ["rng-rank000.*", "mp_rank_00_model_states.pt",
                                    "zero_pp_rank_0_mp_rank_00_optim_states.pt"])
def test_resume_refuses_a_planted_pickle(trained, tmp_path, target):
    cfg, paths = _fork(trained, tmp_path)
    ckpt = paths.checkpoints / "step-000003"
    (file,) = ckpt.glob(target)
    marker = tmp_path / "pwned"
    _plant(file, marker)
    code, out = _run("train", "-c", str(cfg), "--resume")
    assert not marker.exists(), "the planted pickle ran"
    assert code == 1, out[-3000:]
    assert "Traceback" not in out and file.name in out, out[-3000:]
    assert "--checkpoint step-000002" in out  # what to do: the earlier complete checkpoint


def test_legacy_pickled_rng_state_loads_safely_or_is_refused(trained, tmp_path):
    """Checkpoints of older diffpipe versions hold ``rng-rankNNN.pt``: read with weights_only=True."""
    _, paths = _fork(trained, tmp_path)
    ckpt = paths.checkpoints / "step-000003"
    state = ckpts.read_rng(ckpt, 0)
    (ckpt / "rng-rank000.safetensors").unlink()
    torch.save(state, ckpt / "rng-rank000.pt")  # the old format: numpy arrays and tuples inside
    legacy = ckpts.read_rng(ckpt, 0)
    assert torch.equal(legacy["generator"], state["generator"]) and legacy["python"] == state["python"]
    np.testing.assert_array_equal(legacy["numpy"][1], state["numpy"][1])
    marker = tmp_path / "pwned"
    _plant(ckpt / "rng-rank000.pt", marker)
    with pytest.raises(ckpts.CheckpointError, match="rng-rank000.pt"):
        ckpts.read_rng(ckpt, 0)
    assert not marker.exists()


def test_export_refuses_a_planted_pickle_in_a_deepspeed_checkpoint(trained, tmp_path):
    cfg, paths = _fork(trained, tmp_path)
    bare = tmp_path / "ds-only"  # DeepSpeed's files alone: export reads the model states
    bare.mkdir()
    shutil.copy(paths.checkpoints / "step-000003" / "mp_rank_00_model_states.pt", bare)
    marker = tmp_path / "pwned"
    _plant(bare / "mp_rank_00_model_states.pt", marker)
    code, out = _run("export", str(bare), "-c", str(cfg), "--format", "peft")
    assert not marker.exists(), "the planted pickle ran"
    assert code == 1 and "Traceback" not in out, out[-3000:]
    assert "mp_rank_00_model_states.pt" in out


def test_export_of_a_diffpipe_checkpoint_reads_no_pickle(trained, tmp_path):
    from diffpipe.export.locate import locate

    _, paths = _fork(trained, tmp_path)
    ckpt = paths.checkpoints / "step-000003"
    marker = tmp_path / "pwned"
    for f in ckpt.glob("*.pt"):
        _plant(f, marker)
    found = locate(ckpt, None)
    assert (found.adapter_dir / "adapter_model.safetensors").is_file() and not marker.exists()


# -- item 13: resume sees the data's content --------------------------------------------
def _recache(cfg_file: Path) -> None:
    """validate, plan and cache again (what `diffpipe run` does after a dataset edit)."""
    from diffpipe import stages
    from diffpipe.config import load_config

    cfg = load_config(cfg_file)
    stages.prepare_data(cfg, RunPaths(cfg.output_dir), empty_caption=False)


def test_resume_refuses_edited_captions_and_images(trained, tmp_path):
    data = trained / "data"  # the run's own dataset, edited in place (and restored)
    cfg, paths = _fork(trained, tmp_path)
    caption, image = data / "shape_003.txt", data / "shape_005.png"
    saved = {f: f.read_bytes() for f in (caption, image)}
    try:
        caption.write_text("a purple star on a green background")
        pixels = np.array(Image.open(image).convert("RGB"))
        pixels[:8, :8] = 255 - pixels[:8, :8]
        Image.fromarray(pixels).save(image)
        _recache(cfg)
    finally:
        for f, content in saved.items():
            f.write_bytes(content)
    code, out = _run("train", "-c", str(cfg), "--resume")
    assert code == 2 and "Traceback" not in out, out[-3000:]
    assert re.search(r"caption changed: \S*shape_003", out) and re.search(r"image changed: \S*shape_005", out), out


# -- item 14: damage names the file and the way out -----------------------------------------
def test_truncated_checkpoint_file_is_named_with_the_way_out(trained, tmp_path):
    cfg, paths = _fork(trained, tmp_path)
    ckpt = paths.checkpoints / "step-000003"
    states = ckpt / "mp_rank_00_model_states.pt"
    states.write_bytes(states.read_bytes()[: states.stat().st_size // 2])
    code, out = _run("train", "-c", str(cfg), "--resume")
    assert code == 1 and "Traceback" not in out, out[-3000:]
    assert "mp_rank_00_model_states.pt" in out and "--checkpoint step-000002" in out

    # Our own files: the RNG state and the metadata.
    rng = ckpt / "rng-rank000.safetensors"
    rng.write_bytes(rng.read_bytes()[:100])
    with pytest.raises(ckpts.CheckpointError, match=r"rng-rank000\.safetensors.*--checkpoint step-000002"):
        ckpts.read_rng(ckpt, 0)
    meta = ckpt / "diffpipe.json"
    meta.write_text(meta.read_text()[:50])
    with pytest.raises(ckpts.CheckpointError, match=r"diffpipe\.json.*--checkpoint step-000002"):
        ckpts.read_meta(ckpt)


def test_stray_folders_neither_block_resume_nor_get_deleted(trained, tmp_path):
    cfg, paths = _fork(trained, tmp_path, keep_checkpoints=1)
    root = paths.checkpoints
    shutil.copytree(root / "step-000003", root / "step-000012.bak")  # a user's backup: complete, odd name
    shutil.rmtree(root / "step-000003")  # the run was killed after step 2's checkpoint
    (root / "step-000009").mkdir()  # incomplete (no diffpipe.json)
    (root / ".tmp-mine").mkdir()  # not a name diffpipe gives its temporary folders
    (root / ".tmp-mine" / "notes.txt").write_text("mine")
    assert [p.name for p in ckpts.list_checkpoints(root)] == ["step-000002"]
    assert ckpts.resolve_checkpoint(root).name == "step-000002"
    code, out = _run("train", "-c", str(cfg), "--resume")
    assert code == 0 and "resumed from step 2" in out, out[-3000:]
    # keep_checkpoints: 1 pruned step 2; nothing diffpipe did not name was touched.
    left = sorted(p.name for p in root.iterdir() if not p.name.startswith("zero_to_"))  # DeepSpeed's scripts
    assert left == [".tmp-mine", "step-000003", "step-000009", "step-000012.bak"]
    assert (root / ".tmp-mine" / "notes.txt").read_text() == "mine"


def test_damaged_array_metadata_names_the_shard_and_file(trained, tmp_path):
    from diffpipe.data.cache.reader import CachedDataset

    cfg, paths = _fork(trained, tmp_path)
    shard = paths.latent_shard("s0000")
    (array_meta,) = [p for p in shard.glob("*/zarr.json")]
    array_meta.write_text(array_meta.read_text()[:100])  # truncated
    with pytest.raises(ValueError) as err:
        CachedDataset.from_run(paths)
    msg = str(err.value)
    assert str(array_meta) in msg and "rerun" in msg and "delete" in msg, msg
    code, out = _run("cache", "verify", "-c", str(cfg))
    assert code == 1 and "Traceback" not in out and str(array_meta) in out, out[-3000:]


def test_truncated_adapter_is_named_by_export(trained, tmp_path):
    from diffpipe.export.locate import model_config_from_adapter

    _, paths = _fork(trained, tmp_path)
    ckpt = paths.checkpoints / "step-000003"
    weights = ckpt / "adapter" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:300])
    with pytest.raises(ckpts.CheckpointError, match=r"adapter.*is damaged.*--checkpoint step-000002"):
        ckpts.adapter_from_checkpoint(ckpt, tmp_path / "out")
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors is damaged"):
        model_config_from_adapter(ckpt / "adapter")
