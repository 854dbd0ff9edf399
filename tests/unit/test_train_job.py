"""``diffpipe train`` as a process (diffpipe.train_job): the run folder's locks, and the ranks it relaunches."""

from pathlib import Path

import pytest

from diffpipe import runlock
from diffpipe.config import parse_config
from diffpipe.paths import RunPaths
from diffpipe.train_job import TrainRequest, run_train_job

_DIST = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS", "SLURM_STEP_ID",
         "SLURM_PROCID", runlock.HELD_ENV)


def _run(tmp_path, monkeypatch):
    for name in _DIST:  # a lone `diffpipe train`, not a launched rank
        monkeypatch.delenv(name, raising=False)
    cfg = parse_config({"output_dir": str(tmp_path / "run"), "datasets": [{"name": "d", "path": str(tmp_path / "data")}]})
    return cfg, RunPaths(cfg.output_dir)


@pytest.mark.parametrize(("lock", "holder"), [(runlock.TRAIN_LOCK, "diffpipe train"), (runlock.RUN_LOCK, "diffpipe run")])
def test_train_job_lock_refuses_a_second_writer_before_training(tmp_path, monkeypatch, lock, holder):
    """A trainer beside another trainer, or beside a `diffpipe run`, stops before any model loads."""
    cfg, paths = _run(tmp_path, monkeypatch)
    with runlock.hold(paths.root, lock, holder), pytest.raises(runlock.FolderLocked, match=holder):
        run_train_job(cfg, paths, TrainRequest(Path("c.yaml")), log=print)
    assert not paths.train_dir.exists()


def test_train_job_relaunches_each_rank_with_the_same_flags():
    request = TrainRequest(Path("my config.yaml"), 2, resume=True, checkpoint="step-000010", auto_resume=True)
    assert request.argv() == ["train", "--config", "my config.yaml", "--processes", "2", "--resume",
                              "--checkpoint", "step-000010", "--auto-resume"]
    assert TrainRequest(Path("c.yaml"), 2).argv() == ["train", "--config", "c.yaml", "--processes", "2"]
