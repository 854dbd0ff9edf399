"""Memory that plans itself: the fastest memory setting whose estimate fits a GPU (``train.memory: auto``,
``diffpipe plan-memory``).

The planner searches the memory keys the user left unset (``train.base_weights``,
``activation_checkpointing``, ``block_swap``, ``activation_offload``, and for ``mode: full``
``optimizer_in_backward``; a key written in the config is never changed) with one :func:`diffpipe.estimate.estimate_memory` call per (base weights, checkpointing, offload)
combination: ``block_swap`` comes from :meth:`MemoryEstimate.swap_to_fit` on the checkpointed estimate,
without a new call. The estimates of one plan share a :class:`~diffpipe.meta_denoiser.Reuse`: the meta
denoiser is built once (fp8's and int8's are converted copies of it; bf16 and nf4 share it) and one forward
of each of these three counts its saves with checkpointing and without, so the rest is arithmetic. A setting fits
when its estimate plus :func:`margin_bytes` is within the GPU budget and what it keeps in CPU memory within
the system-RAM budget (when one is given).

Ranking (:data:`STEP_COST`, :data:`TRANSFERS`, :data:`QUALITY`): each setting's step time relative to the
plain bf16 step is 1 + the table's extra cost of each option + the seconds its host-device copies take per
step over the assumed PCIe bandwidth, divided by an estimated step time (6 FLOPs per parameter per latent
token over an assumed throughput). Among the settings within ``slowdown`` of the fastest one that fits,
the best base weights (bf16 > fp8 > int8 > nf4) win, then the faster; a lower-quality base weight is chosen
only when it is more than ``slowdown`` faster than every better one that fits.

The workflow's train rule reruns when the planned settings change (:func:`digest_settings`, in
:func:`diffpipe.stages.stage_digest`), never for the budget alone; docs/training.md's fits table is
:func:`plan_memory`'s choice per card (:mod:`diffpipe.fits`).
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from diffpipe.config import Config, ConfigError
from diffpipe.estimate import GiB, MemoryEstimate, estimate_memory
from diffpipe.families.published import PUBLISHED
from diffpipe.meta_denoiser import Reuse

#: What the CUDA context and the allocator's fragmentation add to an estimate (diffpipe.estimate's docstring: 1-2 GiB).
CONTEXT_BYTES = 3 * GiB // 2
#: The memory keys the planner sets (those the user left unset).
KEYS = ("base_weights", "activation_checkpointing", "block_swap", "activation_offload", "optimizer_in_backward")
#: Share of the estimate kept free for its error: docs/training.md puts the estimate at 0.88-1.01 of the
#: measured peak on CPU at real width (on an H200: FLUX.1-dev bf16 + checkpointing 1.000, Qwen-Image nf4 1.014),
#: so 15% covers the worst measured under-estimate with room to spare.
ESTIMATE_ERROR = 0.15
#: Extra step time of an option, as a share of the plain bf16 step. Checkpointing recomputes each block's
#: forward in the backward pass: about 1/3 of the forward + backward FLOPs. Quantised base weights
#: dequantise each layer for each matmul (more work the fewer the bits).
STEP_COST: dict[tuple[str, Any], float] = {
    ("base_weights", "auto"): 0.0,
    ("base_weights", "fp8"): 0.05,
    ("base_weights", "int8"): 0.10,
    ("base_weights", "nf4"): 0.15,
    ("activation_checkpointing", False): 0.0,
    ("activation_checkpointing", True): 1 / 3,
    # The same optimizer arithmetic, run inside the backward pass: no extra work (and no gradient memory).
    ("optimizer_in_backward", True): 0.0,
}
#: Host-device copies per step of each byte an estimate keeps in CPU memory: a swapped block is copied in for
#: its forward and again for its recomputation; an offloaded activation goes out and comes back. Counted
#: in full, as if no copy overlapped compute (training.offload prefetches the next block: an upper bound).
TRANSFERS = {"cpu_bytes": 2, "activation_cpu_bytes": 2}
#: Assumed host-device bandwidth: half of PCIe 4.0 x16's 32 GB/s peak.
PCIE_BYTES_PER_S = 16e9
#: Assumed training throughput of the GPU (a 24 GB-class card's bf16 tensor rate at a LoRA step's utilisation):
#: only the ratio of copy time to step time depends on it.
STEP_FLOPS_PER_S = 100e12
#: Base weights by quality, best first: a lossy one is chosen only when it is more than ``slowdown`` faster.
QUALITY = {"auto": 0, "fp8": 1, "int8": 2, "nf4": 3}
#: Default slowdown bound: a better base weight is kept while its setting is at most 10% slower.
SLOWDOWN = 0.10


@dataclass(frozen=True)
class Candidate:
    """One memory setting with its estimate and relative step time (1: plain bf16)."""

    settings: dict[str, Any]
    estimate: MemoryEstimate
    cost: float

    def short(self) -> str:
        """The settings and estimate in a few words (the fits table's cells): ``fp8 + checkpointing + block_swap
        18: 12.6 GiB + 4.7 GiB system RAM, step x1.60``."""
        e = self.estimate
        ram = e.cpu_bytes + e.activation_cpu_bytes
        return (f"{settings_text(self.settings)}: {e.total_bytes / GiB:.1f} GiB"
                + (f" + {ram / GiB:.1f} GiB system RAM" if ram else "") + f", step x{self.cost:.2f}")

    def describe(self) -> str:
        s = self.settings
        parts = [f"base_weights {'bf16' if s['base_weights'] == 'auto' else s['base_weights']}",
                 f"activation_checkpointing {'on' if s['activation_checkpointing'] else 'off'}",
                 f"block_swap {s['block_swap']}", f"activation_offload {'on' if s['activation_offload'] else 'off'}"]
        if "optimizer_in_backward" in s:
            parts.append(f"optimizer_in_backward {'on' if s['optimizer_in_backward'] else 'off'}")
        e = self.estimate
        ram = e.cpu_bytes + e.activation_cpu_bytes
        return (", ".join(parts) + f": estimate {e.total_bytes / GiB:.2f} GiB + margin {margin_bytes(e) / GiB:.2f} GiB"
                + (f", {ram / GiB:.2f} GiB in system RAM" if ram else "") + f", step time x{self.cost:.2f}")


@dataclass(frozen=True)
class MemoryPlan:
    """The chosen setting and the runner-up for a GPU budget (bytes), and the keys the user wrote."""

    chosen: Candidate
    runner_up: Candidate | None
    gpu_bytes: int
    system_bytes: int | None
    explicit: tuple[str, ...] = field(default=())

    def lines(self) -> list[str]:
        ram = f", system RAM {self.system_bytes / GiB:.1f} GiB" if self.system_bytes is not None else ""
        kept = f"; kept as written: {', '.join(self.explicit)}" if self.explicit else ""
        return [f"budget: GPU {self.gpu_bytes / GiB:.1f} GiB{ram}; margin: {CONTEXT_BYTES / GiB:.1f} GiB CUDA "
                f"context + {ESTIMATE_ERROR:.0%} of the estimate{kept}",
                f"chosen: {self.chosen.describe()}",
                f"runner-up: {self.runner_up.describe() if self.runner_up else 'none (no other setting fits)'}"]

    def as_dict(self) -> dict[str, Any]:
        def one(c: Candidate | None) -> dict[str, Any] | None:
            return None if c is None else {**c.settings, "estimate_bytes": c.estimate.total_bytes,
                                           "margin_bytes": margin_bytes(c.estimate), "step_cost": round(c.cost, 4)}

        return {"gpu_bytes": self.gpu_bytes, "system_bytes": self.system_bytes, "explicit": list(self.explicit),
                "chosen": one(self.chosen), "runner_up": one(self.runner_up)}


class NothingFits(ValueError):
    """No setting fits the budget; the message names the closest and by how much it misses."""


def settings_text(settings: dict[str, Any]) -> str:
    """Memory settings as the docs write them: ``bf16 + checkpointing + block_swap 29``."""
    base = settings.get("base_weights", "auto")
    parts = ["bf16" if base == "auto" else base]
    parts += ["checkpointing"] if settings.get("activation_checkpointing") else []
    parts += [f"block_swap {settings['block_swap']}"] if settings.get("block_swap") else []
    parts += ["activation_offload"] if settings.get("activation_offload") else []
    parts += ["optimizer in backward"] if settings.get("optimizer_in_backward") else []
    return " + ".join(parts)


def margin_bytes(estimate: MemoryEstimate) -> int:
    """What a setting must leave free beside its estimate: the CUDA context and fragmentation, and the
    estimate's measured error (:data:`ESTIMATE_ERROR`)."""
    return CONTEXT_BYTES + int(ESTIMATE_ERROR * estimate.total_bytes)


def step_seconds(estimate: MemoryEstimate) -> float:
    """The plain step's estimated time: 6 FLOPs per parameter per latent token (2x2 patches of the VAE's
    latents; video: 4x temporal compression) over :data:`STEP_FLOPS_PER_S`."""
    spec = PUBLISHED.get(estimate.model)
    side = 2 * (spec.vae_factor if spec else 8)
    frames = (estimate.frames - 1) // 4 + 1
    tokens = estimate.batch_size * (estimate.resolution // side) * ((estimate.height or estimate.resolution) // side)
    return 6 * estimate.params * max(tokens * frames, 1) / STEP_FLOPS_PER_S


def step_cost(settings: dict[str, Any], estimate: MemoryEstimate) -> float:
    """Relative step time of a setting (1: plain bf16), from the tables above."""
    extra = sum(STEP_COST.get((k, v), 0.0) for k, v in settings.items())
    copies = sum(n * getattr(estimate, attr) for attr, n in TRANSFERS.items()) / PCIE_BYTES_PER_S
    return 1 + extra + copies / step_seconds(estimate)


Estimator = Callable[[Config], MemoryEstimate]


def explicit_keys(cfg: Config) -> tuple[str, ...]:
    """The memory keys the config writes (pydantic's ``model_fields_set``): the planner keeps them as written."""
    return tuple(k for k in KEYS if k in cfg.train.model_fields_set)


def plan_memory(cfg: Config, gpu_bytes: int, *, system_bytes: int | None = None, slowdown: float = SLOWDOWN,
                estimate: Estimator | None = None, **sizes: Any) -> MemoryPlan:
    """The fastest memory setting that fits ``gpu_bytes`` (and ``system_bytes`` of RAM, if given), and the
    runner-up, searching only the keys of :data:`KEYS` the config leaves unset.

    ``sizes`` go to :func:`estimate_memory` (``model``, ``resolution``, ``height``, ``frames``), whose
    estimates share one :class:`~diffpipe.meta_denoiser.Reuse` (module docstring), freed once the plan is
    made; ``estimate`` replaces it (tests share estimates between budgets). Raises :class:`NothingFits`.
    """
    if estimate is None:
        with Reuse() as reuse:
            return plan_memory(cfg, gpu_bytes, system_bytes=system_bytes, slowdown=slowdown,
                               estimate=lambda c: estimate_memory(c, reuse=reuse, **sizes))
    given = explicit_keys(cfg)
    fitting: list[Candidate] = []
    closest: tuple[int, Candidate] | None = None
    for base_variants in _variants(cfg, given):
        for settings, candidate_cfg in base_variants:
            est = estimate(candidate_cfg)
            if est.activation_bytes is None:  # a total without activations would fit where training does not
                raise ValueError(f"{est.model}: its activations cannot be measured on the meta device, so no "
                                 "memory plan can be made; set train.memory: manual and the memory keys by hand")
            can_swap = "block_swap" not in given and _with(cfg, {**settings, "block_swap": 1}) is not None
            fit, miss = _fit(settings, est, gpu_bytes, system_bytes, can_swap)
            if fit is None:
                if closest is None or miss[0] < closest[0]:
                    closest = miss
                continue
            fitting.append(fit)
            if not fit.estimate.cpu_bytes and not fit.estimate.activation_cpu_bytes:
                break  # this base's later variants cost more and save memory this one does not need
    if not fitting:
        raise NothingFits(_nothing_fits(closest, gpu_bytes, system_bytes))
    ranked = rank(fitting, slowdown)
    return MemoryPlan(ranked[0], ranked[1] if len(ranked) > 1 else None, gpu_bytes, system_bytes, given)


def rank(candidates: list[Candidate], slowdown: float = SLOWDOWN) -> list[Candidate]:
    """Best first: those within ``slowdown`` of the fastest by base-weight quality, then step time; the rest by
    step time."""
    fastest = min(c.cost for c in candidates)

    def key(c: Candidate) -> tuple[bool, int, float]:
        within = c.cost <= fastest * (1 + slowdown)
        return (not within, QUALITY[c.settings["base_weights"]] if within else 0, c.cost)

    return sorted(candidates, key=key)


def _variants(cfg: Config, given: tuple[str, ...]) -> list[list[tuple[dict[str, Any], Config]]]:
    """Per base weight (best first), the valid (checkpointing, offload) settings cheapest first, each with its
    config (``block_swap`` 0 unless written)."""
    tc = cfg.train

    def values(key: str, choices: list[Any]) -> list[Any]:
        return [getattr(tc, key)] if key in given else choices

    # optimizer_in_backward only for a full fine-tune, and only where the config allows it (grad_clip 0,
    # grad_accum 1, a bf16-safe optimizer under bf16: _with drops the rest); tried before checkpointing,
    # which costs a third more compute where stepping in the backward pass costs none.
    in_backward = values("optimizer_in_backward", [False, True]) if tc.mode == "full" else [None]
    out = []
    for base in values("base_weights", list(QUALITY)):
        variants = []
        for ckpt, off, inb in itertools.product(values("activation_checkpointing", [False, True]),
                                                values("activation_offload", [False, True]), in_backward):
            if off and not ckpt and "activation_offload" not in given:
                continue  # offloading every saved tensor: only where the config asks for it
            settings = {"base_weights": base, "activation_checkpointing": ckpt,
                        "block_swap": tc.block_swap if "block_swap" in given else 0, "activation_offload": off}
            if inb is not None:
                settings["optimizer_in_backward"] = inb
            if (candidate := _with(cfg, settings)) is not None:
                variants.append((settings, candidate))
        out.append(variants)
    return out


def _with(cfg: Config, settings: dict[str, Any]) -> Config | None:
    """``cfg`` with these train settings, or None where the train section refuses them (e.g. nf4 with
    block_swap, fp8 with ZeRO-3)."""
    try:
        train = type(cfg.train).model_validate({**cfg.train.model_dump(), **settings})
    except ValidationError:
        return None
    return cfg.model_copy(update={"train": train})


def _fit(settings: dict[str, Any], est: MemoryEstimate, gpu_bytes: int, system_bytes: int | None,
         can_swap: bool) -> tuple[Candidate | None, tuple[int, Candidate]]:
    """The candidate if it fits (with the fewest blocks swapped that make it fit), and else how far the most
    it can do (every block swapped) misses, in bytes, with that candidate."""
    usable = int((gpu_bytes - CONTEXT_BYTES) / (1 + ESTIMATE_ERROR))  # total + margin_bytes(total) <= gpu_bytes
    n = est.swap_to_fit(usable) if can_swap else (est.block_swap if est.total_bytes <= usable else None)
    if n is not None:
        swapped = est.swapped(n) if can_swap else est
        fit = Candidate({**settings, "block_swap": n}, swapped, step_cost(settings, swapped))
        # The load's peaks count too: RAM while it reads, the GPU before the swap takes its blocks out.
        ram = max(swapped.cpu_bytes + swapped.activation_cpu_bytes, swapped.load_ram_bytes)
        if swapped.load_gpu_bytes + CONTEXT_BYTES > gpu_bytes:
            return None, (swapped.load_gpu_bytes + CONTEXT_BYTES - gpu_bytes, fit)
        if system_bytes is None or ram <= system_bytes:
            return fit, (0, fit)
        return None, (ram - system_bytes, fit)
    most = est.swapped(len(est.block_bytes)) if can_swap else est
    best = Candidate({**settings, "block_swap": most.block_swap}, most, step_cost(settings, most))
    return None, (most.total_bytes + margin_bytes(most) - gpu_bytes, best)


def _nothing_fits(closest: tuple[int, Candidate] | None, gpu_bytes: int, system_bytes: int | None) -> str:
    budget = f"a {gpu_bytes / GiB:.1f} GiB GPU" + (f" and {system_bytes / GiB:.1f} GiB of system RAM"
                                                    if system_bytes is not None else "")
    if closest is None:
        return f"no memory setting fits {budget}: the config's written memory keys leave none to estimate"
    miss, c = closest
    e = c.estimate
    gpu_fits = e.total_bytes + margin_bytes(e) <= gpu_bytes and e.load_gpu_bytes + CONTEXT_BYTES <= gpu_bytes
    over = "system RAM" if gpu_fits else "GPU memory"
    return (f"no memory setting fits {budget}; the closest, {c.describe()}, misses by {miss / GiB:.2f} GiB of "
            f"{over}: train at a smaller resolution or batch, on a larger GPU, or leave more memory keys unset")


def apply_plan(cfg: Config, planned: dict[str, Any]) -> Config:
    """``cfg`` with a plan's settings (:meth:`MemoryPlan.as_dict`) for the keys the config leaves unset (the
    written ones stay)."""
    update = {k: v for k, v in planned["chosen"].items() if k in KEYS and k not in planned["explicit"]}
    return cfg.model_copy(update={"train": cfg.train.model_copy(update=update)})


def training_plan(cfg: Config) -> MemoryPlan | None:
    """The plan ``diffpipe train`` applies under ``train.memory: auto`` (None under ``manual``): for
    ``train.gpu_memory`` GiB, else the free memory of this machine's GPU, and its available system RAM."""
    tc = cfg.train
    if tc.memory != "auto":
        return None
    gpu_bytes = int(tc.gpu_memory * GiB) if tc.gpu_memory is not None else detected_gpu_bytes()
    return plan_memory(cfg, gpu_bytes, system_bytes=available_ram_bytes())


def digest_settings(cfg: Config) -> dict[str, Any] | None:
    """What the train rule's rerun trigger records of ``train.memory: auto`` (None under ``manual``): the planned
    settings of the keys the config leaves unset, never the GPU's bytes, so a card that changes the plan reruns
    train and one that keeps it does not.

    Planned when the workflow starts, for ``train.gpu_memory`` or else the free memory of the GPU visible there
    (read in a child process: a CUDA context in Snakemake's own process would hold memory the train job
    plans for). Without either (a login node with no GPU), or when no plan can be made, the record says so and
    the train job plans and reports alone."""
    tc = cfg.train
    if tc.memory != "auto":
        return None
    gpu_bytes = int(tc.gpu_memory * GiB) if tc.gpu_memory is not None else _free_gpu_bytes_in_child()
    if gpu_bytes is None:
        return {"planned": "by the train job (no train.gpu_memory, no GPU where the workflow started)"}
    try:
        plan = plan_memory(cfg, gpu_bytes, system_bytes=available_ram_bytes())
    except ValueError as err:  # NothingFits, an unmeasurable model: the train job reports it, not the DAG
        return {"planned": f"no plan: {type(err).__name__}"}
    return {k: v for k, v in plan.chosen.settings.items() if k not in plan.explicit}


def _free_gpu_bytes_in_child() -> int | None:
    """The free memory of the first visible CUDA device, read by a short child process; None without one."""
    import torch  # deferred: only memory: auto without gpu_memory asks (start-up time)

    if not torch.cuda.is_available():  # asks the driver; creates no context
        return None
    code = "import torch; print(torch.cuda.mem_get_info()[0])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    return int(done.stdout.strip()) if done.returncode == 0 and done.stdout.strip().isdigit() else None


def detected_gpu_bytes() -> int:
    """Free memory of the current CUDA device; a config error on a machine without one."""
    import torch  # deferred: only a training run on a GPU asks (start-up time)

    if not torch.cuda.is_available():
        raise ConfigError("train.memory: auto plans for a GPU's free memory, and this machine has no CUDA GPU: "
                          "set train.gpu_memory (GiB; plan-memory: --gpu-memory) to plan for a card, or train.memory: manual")
    free, _total = torch.cuda.mem_get_info()
    return int(free)


def available_ram_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo (Linux); None where it cannot be read (no system-RAM limit then)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
