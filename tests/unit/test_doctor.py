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


def test_text_encoders_are_sized_for_the_cache_jobs_gpu(tmp_path):
    """The text encoders a cache job holds: counted on the meta device from a local folder's configs, in
    bf16 they are the folder's weight count x 2 bytes (read from its safetensors files) and the models' own
    small buffers; fp8 holds less;
    a GPU between the two is told to set model.text_encoder_weights: fp8."""
    from safetensors import safe_open

    from diffpipe.config import ModelConfig
    from diffpipe.doctor import CUDA_OVERHEAD_BYTES, _text_encoder_checks, text_encoder_bytes
    from diffpipe.families import get_family

    folder = tmp_path / "flux"
    get_family(ModelConfig(family="flux")).load_pipeline().save_pretrained(folder)
    numel = 0
    for file in [*folder.glob("text_encoder/*.safetensors"), *folder.glob("text_encoder_2/*.safetensors")]:
        with safe_open(str(file), "pt") as f:
            numel += sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())
    base = {"output_dir": str(tmp_path / "run"), "datasets": [{"name": "d", "path": str(tmp_path / "data")}]}

    def cfg(**model):
        return parse_config({**base, "model": {"path": str(folder), **model}})

    plain, fp8 = cfg(), cfg(text_encoder_weights="fp8")
    # Besides the files' weights: the buffers a model builds itself (CLIP's int64 position ids, 616 bytes).
    assert 0 <= text_encoder_bytes(plain) - 2 * numel <= 1024
    assert 0 < text_encoder_bytes(fp8) < 2 * numel
    between = CUDA_OVERHEAD_BYTES + (text_encoder_bytes(plain) + text_encoder_bytes(fp8)) // 2
    (warn,) = _text_encoder_checks(plain, between)
    assert not warn.ok and "text_encoder_weights: fp8" in warn.fix and "text encoders" in warn.line()
    (ok,) = _text_encoder_checks(fp8, between)
    assert ok.ok and "stored in fp8" in ok.detail
    assert _text_encoder_checks(parse_config(base), between) == []  # the tiny flavor: nothing to size
