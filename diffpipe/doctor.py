"""``diffpipe doctor``: can this machine run what the config asks? One line per check, each with its fix.

Nothing here changes the machine; a check that cannot decide says so as a warning.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from diffpipe import hub
from diffpipe.config import Config, load_yaml

GiB = 1024**3
#: Free space below which the output or cache folder's file system gets a warning.
MIN_FREE_BYTES = 20 * GiB
#: What the CUDA context and allocator fragmentation add to ``diffpipe estimate``'s total.
CUDA_OVERHEAD_BYTES = 2 * GiB
#: A torch extension build (DeepSpeed JIT-builds its CPU ops at the first start) takes a minute or two; a
#: lock older than this was left by a build that was killed.
STALE_LOCK_SECONDS = 15 * 60
TORCH_CUDA_FIX = ('install a CUDA build of torch: make venv TORCH_SPEC="torch==<version> --index-url '
                  'https://download.pytorch.org/whl/cu128" (on a fresh .venv)')


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'warn'}  {self.name}: {self.detail}" + ("" if self.ok else f"; fix: {self.fix}")


def _torch_checks(cfg: Config | None, estimate) -> list[Check]:
    cuda = torch.version.cuda
    checks = [Check("torch", bool(cuda), f"{torch.__version__}, " + (f"CUDA {cuda} build" if cuda else "CPU-only build"),
                    TORCH_CUDA_FIX)]
    gpus = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())] if cuda else []
    if not gpus:
        checks.append(Check("GPUs", False, "none visible (training runs on CPU: fine for the tiny models, far too "
                            "slow for published ones)", "run on a machine with an NVIDIA GPU and a CUDA build of "
                            "torch" if cuda else TORCH_CUDA_FIX))
    else:
        names = ", ".join(f"{g.name} {g.total_memory / GiB:.0f} GiB" for g in gpus)
        checks.append(Check("GPUs", True, f"{len(gpus)}: {names}"))
    if estimate is not None:
        need = estimate.total_bytes + CUDA_OVERHEAD_BYTES
        have = min((g.total_memory for g in gpus), default=0)
        what = f"the config needs about {need / GiB:.1f} GiB per GPU (diffpipe estimate, plus CUDA overhead" + (
            f"; the tiny flavor is sized as {estimate.model})" if cfg.model.flavor == "tiny" else ")")
        fits = bool(gpus) and need <= have
        checks.append(Check("GPU memory", fits, what + (f"; the smallest GPU has {have / GiB:.0f} GiB" if gpus else
                            "; no GPU to hold it"), "on one GPU: train.memory: auto (`diffpipe plan-memory -c CONFIG` shows its pick), or by hand "
                            "train.base_weights fp8 (or nf4), "
                            "activation_checkpointing, then block_swap N and activation_offload (system RAM); "
                            "or lower train.batch_size or the resolution; on several GPUs also zero_stage / "
                            "offload_optimizer. `diffpipe estimate -c CONFIG` shows each one's effect "
                            "(--gpus N for several), docs/training.md's table what fits 24/16/12 GiB"))
    return checks


def _plan_checks(cfg: Config, gpu_bytes: int) -> list[Check]:
    """Under ``train.memory: auto``: the plan train would make (for ``train.gpu_memory``, else the smallest
    GPU's memory), its settings and the runner-up's, each with its estimate."""
    if cfg.train.memory != "auto":
        return []
    # deferred: the planner sizes the model on the meta device (seconds); only memory: auto asks
    from diffpipe import memory_plan as mp

    budget = int(cfg.train.gpu_memory * GiB) if cfg.train.gpu_memory is not None else gpu_bytes
    if not budget:
        return [Check("memory plan", False, "train.memory: auto, and no GPU here to plan for",
                      "set train.gpu_memory (GiB) to plan for a card, or see `diffpipe plan-memory --gpu-memory N`")]
    try:
        plan = mp.plan_memory(cfg, budget, system_bytes=mp.available_ram_bytes())
    except ValueError as err:  # NothingFits names the closest setting and its miss
        return [Check("memory plan", False, str(err), "see the message")]
    return [Check("memory plan", True, "; ".join(plan.lines()))]


def _smallest_gpu() -> int:
    """The smallest visible GPU's memory in bytes (0: none)."""
    if not torch.cuda.is_available():
        return 0
    return min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))


def _library_checks() -> list[Check]:
    checks = []
    for module, label, pip in (("flash_attn", "flash attention", "flash-attn"),
                               ("sageattention", "sage attention", "sageattention")):
        found = importlib.util.find_spec(module) is not None
        checks.append(Check(label, found, "installed" if found else "not installed (optional: PyTorch's own "
                            "attention is used)", f"pip install {pip} (needs a CUDA GPU) for faster attention"))
    try:  # deferred: deepspeed takes seconds to import, and a broken install is what this check reports
        import deepspeed.ops

        ops = getattr(deepspeed.ops, "__compatible_ops__", {})
        usable = sorted(k for k, v in ops.items() if v)
        missing = sorted(k for k, v in ops.items() if not v and k != "deepspeed_not_implemented")
        checks.append(Check("DeepSpeed ops", "cpu_adam" in usable and "fused_adam" in usable,
                            f"{deepspeed.__version__}; buildable: {', '.join(usable) or 'none'}"
                            + (f"; not buildable here: {', '.join(missing)}" if missing else ""),
                            "install a C++ compiler (and the CUDA toolkit matching torch for GPU ops), then run "
                            "ds_report"))
    except Exception as err:  # DeepSpeed missing or broken: that is the finding
        checks.append(Check("DeepSpeed", False, f"cannot be imported ({type(err).__name__}: {err})",
                            "reinstall: pip install -e . in this repository"))
    return checks


def _extension_lock_checks(now: float | None = None) -> list[Check]:
    """Locks of torch extension builds left by a killed build: DeepSpeed waits on one forever at start."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    now = time.time() if now is None else now
    stale = sorted(p for p in root.glob("*/*/lock") if now - p.stat().st_mtime > STALE_LOCK_SECONDS)
    if not stale:
        return [Check("torch extension builds", True, f"no stale build lock under {root}")]
    return [Check("torch extension builds", False,
                  f"{len(stale)} build lock(s) older than {STALE_LOCK_SECONDS // 60} min, left by a killed build: "
                  + ", ".join(str(p) for p in stale) + " (DeepSpeed waits on such a lock forever when it starts)",
                  "when no build is running, delete " + " ".join(str(p) for p in stale))]


def text_encoder_bytes(cfg: Config) -> int | None:
    """The bytes of a local model's text encoders as a cache job holds them on one GPU (all at once): built
    from the folder's configs on the meta device (no weights read), in ``model.text_encoder_dtype`` (``auto``:
    bf16, the GPU's), stored as ``model.text_encoder_weights`` says; None for a tiny, hub-id or undeclared
    text side."""
    # deferred: diffusers and the family registry add seconds to torch's import; only a local model's check needs them
    from diffusers import ModelMixin

    from diffpipe.families import get_family
    from diffpipe.models import _common as common
    from diffpipe.models.casting import enable_fp8_text_encoder
    from diffpipe.models.components import TextEncoder

    m = cfg.model
    if m.flavor != "local" or not m.path or not Path(m.path).is_dir():
        return None
    parts = get_family(m).text_parts
    if not parts:
        return None
    dtype = common.load_dtype(m, "text_encoder", cuda=True)
    total = 0
    for name, part in parts.items():
        if not isinstance(part, TextEncoder):
            continue
        with torch.device("meta"):
            if issubclass(part.cls, ModelMixin):
                model = part.cls.from_config(part.cls.load_config(m.path, subfolder=name))
            else:
                model = part.cls._from_config(part.config_cls.from_pretrained(m.path, subfolder=name))
        model.to(dtype)
        if m.text_encoder_weights == "fp8":
            enable_fp8_text_encoder(model, dtype)
        total += sum(t.nbytes for t in [*model.parameters(), *model.buffers()])  # tied weights once
    return total


def _text_encoder_checks(cfg: Config, gpu_bytes: int) -> list[Check]:
    """Whether the cache jobs' text encoders fit the smallest GPU (``gpu_bytes``) beside the CUDA overhead."""
    held = text_encoder_bytes(cfg)
    if held is None or not gpu_bytes:
        return []
    need = held + CUDA_OVERHEAD_BYTES
    stored = "stored in fp8" if cfg.model.text_encoder_weights == "fp8" else "in model.text_encoder_dtype"
    detail = (f"the text-cache jobs hold {held / GiB:.1f} GiB of text encoders ({stored}) on a "
              f"{gpu_bytes / GiB:.0f} GiB GPU")
    fix = ("set model.text_encoder_weights: fp8 (about half the weights; part of the text cache key)"
           if cfg.model.text_encoder_weights != "fp8" else "cache the text on a larger GPU")
    return [Check("text encoders", need <= gpu_bytes, detail, fix)]


def _existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _model_checks(cfg: Config) -> list[Check]:
    """A Hugging Face id in ``model.path``: the snapshot it resolves to (the one every stage reads)."""
    if not cfg.model.path or not hub.is_model_id(cfg.model.path):
        return []
    try:
        snap = hub.snapshot(cfg.model.path, cfg.model.revision, cfg.model.weight_variant)
    except hub.HubError as err:
        return [Check("model", False, str(err), "see the message")]
    return [Check("model", True, f"{cfg.model.path} (revision {cfg.model.revision or 'main'}) is snapshot "
                  f"{snap.name} in {snap.parent.parent}")]


def _disk_checks(cfg: Config, base: Path, min_free: int) -> list[Check]:
    folders = {"output_dir": base / cfg.output_dir}
    if cfg.cache.dir:
        folders["cache.dir"] = base / cfg.cache.dir
    checks = []
    for key, folder in folders.items():
        free = shutil.disk_usage(_existing(folder)).free
        checks.append(Check(f"disk for {key}", free >= min_free, f"{folder}: {free / GiB:.1f} GiB free",
                            f"free space there, or point {key} at a larger file system (caches and "
                            f"checkpoints of published models take tens of GiB; {min_free / GiB:.0f} GiB is "
                            "the least this check accepts)"))
    return checks


def _slurm_checks(profile: Path) -> list[Check]:
    settings = load_yaml(profile / "config.yaml") if (profile / "config.yaml").is_file() else {}
    if not isinstance(settings, dict) or settings.get("executor") != "slurm":
        return []
    missing = [t for t in ("sbatch", "squeue", "sacct", "srun") if shutil.which(t) is None]
    return [Check("SLURM tools", not missing, f"profile {profile} submits with sbatch; "
                  + (f"not on PATH: {', '.join(missing)}" if missing else "sbatch, squeue, sacct, srun found"),
                  "run from a login node of the cluster (or load its SLURM module)")]


def run_checks(cfg: Config | None = None, *, base: Path = Path("."), profile: Path | None = None,
               min_free: int = MIN_FREE_BYTES) -> list[Check]:
    """Every check, in a fixed order; a config adds memory and disk checks, a SLURM profile the SLURM tools."""
    estimate = None
    if cfg is not None:
        # deferred: estimate loads the family registry, diffusers and peft (seconds); doctor without a config skips it
        from diffpipe.estimate import estimate_memory

        estimate = estimate_memory(cfg)
    checks = _torch_checks(cfg, estimate) + _library_checks() + _extension_lock_checks()
    if cfg is not None:
        gpu = _smallest_gpu()
        checks += _plan_checks(cfg, gpu) + _model_checks(cfg) + _text_encoder_checks(cfg, gpu) + _disk_checks(cfg, base, min_free)
    if profile is not None:
        checks += _slurm_checks(profile)
    return checks
