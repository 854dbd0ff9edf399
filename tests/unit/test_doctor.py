"""`diffpipe doctor`: one ok/warn line per check, each warning with its fix."""

import torch

from diffpipe.config import parse_config
from diffpipe.doctor import STALE_LOCK_SECONDS, run_checks


def test_checks_name_what_is_missing_and_the_fix(tmp_path, monkeypatch):
    cfg = parse_config({"output_dir": str(tmp_path / "run"), "datasets": [{"name": "d", "path": str(tmp_path / "d")}],
                        "cache": {"dir": str(tmp_path / "store")}})
    profile = tmp_path / "slurm"
    profile.mkdir()
    (profile / "config.yaml").write_text("executor: slurm\njobs: 4\n")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no sbatch here
    checks = {c.name: c for c in run_checks(cfg, base=tmp_path, profile=profile, min_free=2**60)}
    assert checks["torch"].ok == bool(torch.version.cuda)
    assert torch.cuda.is_available() or not checks["GPU memory"].ok  # no GPU holds any estimate
    assert "GiB per GPU" in checks["GPU memory"].detail and "sd15" in checks["GPU memory"].detail
    for key in ("output_dir", "cache.dir"):  # nothing has 2**60 bytes free
        disk = checks[f"disk for {key}"]
        assert not disk.ok and key in disk.fix and "GiB free" in disk.line()
    slurm = checks["SLURM tools"]
    assert not slurm.ok and "sbatch" in slurm.detail and "login node" in slurm.line()
    assert "DeepSpeed ops" in checks and "cpu_adam" in checks["DeepSpeed ops"].detail


def test_doctor_without_config_prints_one_line_per_check(cli):
    result = cli("doctor")
    assert result.returncode == 0, result.stderr
    lines = [x for x in result.stderr.splitlines() if x.startswith(("ok  ", "warn"))]
    assert [x.split(":")[0].split(None, 1)[1] for x in lines][:2] == ["torch", "GPUs"]
    assert all("; fix: " in x for x in lines if x.startswith("warn"))


def test_a_stale_torch_extension_build_lock_is_named_with_its_fix(tmp_path, monkeypatch):
    """A build killed midway leaves its lock; DeepSpeed's next start then waits on it forever."""
    import os
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()  # a build running now: not stale
    assert {c.name: c for c in run_checks()}["torch extension builds"].ok
    old = time.time() - STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    check = {c.name: c for c in run_checks()}["torch extension builds"]
    assert not check.ok and str(lock) in check.detail and f"delete {lock}" in check.fix
    assert lock.exists()  # doctor reports; it changes nothing
