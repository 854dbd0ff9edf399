"""GPU memory per process for a training config, from the denoiser on the ``meta`` device.

``estimate_memory`` builds the denoiser at its real size on the ``meta``
device (no memory, no weights: the published config, or the local folder's),
adds the LoRA the config asks for, and counts:

- **parameters**: every denoiser weight in the training dtype, or at one
  byte plus a bf16 scale per output channel where ``train.base_weights:
  fp8`` stores it as scaled float8 (applied to the meta model, so exactly
  the layers it stores count; each matmul dequantises its layer into one
  transient copy, the largest layer's counted with the activations), or at
  one byte plus a float32 scale per output channel where ``base_weights:
  int8`` quantises it (the same layers, torchao's int8 weight-only layout,
  whose matmul saves a bf16 copy of the weight for the backward pass: the
  meta model counts those copies through diffusers' layerwise casting of
  the same layers), or at half a byte plus NF4's
  scales where ``nf4`` does (its autograd function saves the 4-bit weight:
  no copy is saved, but each matmul dequantises its layer through
  temporaries, the largest layer's counted with the activations); ZeRO-3
  divides them over the GPUs. ``train.block_swap: N``
  moves the frozen weights of the last N blocks to CPU memory: they count
  as ``cpu_bytes``, and the largest of them as resident (the block that
  runs; see ``diffpipe.training.offload``);
- **gradients**: one per trainable parameter in the training dtype (ZeRO-2
  and 3 divide them), plus the float32 copy DeepSpeed's bf16 wrapper makes of
  each for its master weights without ZeRO (measured: ``benchmarks/real_width_memory.py``); with ``train.optimizer_in_backward`` only the largest
  trainable parameter's (each gradient is freed once its parameter is stepped);
- **optimizer state**: float32 moments (AdamW: two per trainable parameter)
  plus DeepSpeed's float32 master copy under bf16 (ZeRO-1 and up divide
  them; ``offload_optimizer`` moves them to CPU memory); ``adamw8bit`` /
  ``adamw4bit`` count torchao's layout tensor by tensor: a tensor of 4096+
  values that is a multiple of the block holds one or half a byte per value
  and moment plus a float32 scale per block, any other keeps full-width
  moments, plus the step's float32 workspace for the largest tensor (8 or
  26 bytes per value, measured); ``optimizer_in_backward`` under bf16 has no
  master copy (the bf16 weights are stepped themselves);
- **activations**: measured, not modelled: one training forward (the
  family's own ``loss``) runs on ``meta`` tensors of the real batch and
  resolution, and every tensor autograd saves for the backward pass is
  counted once (by storage), weights excluded. Attention is counted as a
  fused kernel (flash / memory-efficient attention, as on a GPU) keeps it:
  query, key, value, output and the log-sum-exp, never the score matrix.
  Under int8 the layer's compute-dtype copy of its weight is saved too (a
  frozen Linear's backward needs it); scaled fp8 and nf4 save their codes,
  which are weights. With ``train.activation_checkpointing`` the same
  forward runs with diffusers' checkpointing switched on and every
  checkpointed block counted apart: what the block receives is kept for
  the whole step, what it saves internally only while it is recomputed,
  so the peak is everything kept plus the largest block's internal saves.
  Video: ``frames`` pixel frames become ``(frames - 1) / s + 1`` latent
  frames (``s``: the family's temporal compression).

The load's peaks (``load_ram_bytes``, ``load_gpu_bytes``, ``diffpipe.training.load.load_peak``): a
streamed load holds the swapped blocks and one tensor in flight in system RAM and the rest on the GPU;
a denoiser loaded whole holds the whole model at its load dtype in RAM, then every block on the GPU.

No separate term for the backward pass: it frees each saved tensor once its
node has run while it creates the gradients, and the CPU measurements
(``benchmarks/real_width_memory.py``, docs/training.md) put the peak within
15% of the forward's saved tensors with and without checkpointing. Not
counted: the CUDA context and allocator fragmentation (add 1-2 GiB), the VAE
and text encoders (not loaded while training: the caches hold their outputs).

Estimates that share a :class:`~diffpipe.meta_denoiser.Reuse` (a memory plan's candidates, the docs' fits
table's columns) build each meta denoiser and trace each forward once; that module says what each depends
on, and each estimate equals the one made alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from typing import TypedDict, Unpack

import diffusers
import torch
import torch.fx.experimental._config as fx_config

from diffpipe.config import (
    BF16_OPTIMIZERS,
    QUANTISED_OPTIMIZERS,
    Config,
    ModelConfig,
    ObjectiveConfig,
    TokenRoutingConfig,
    TrainConfig,
)
from diffpipe.families import get_family
from diffpipe.families.published import PUBLISHED, Published, for_family
from diffpipe.meta_denoiser import Build, MetaDenoiser, Reuse, Trainable, module_kind
from diffpipe.models._common import load_dtype
from diffpipe.models.base import Family
from diffpipe.models.routing import TokenRoute
from diffpipe.saved_activations import placed, saved_bytes_each
from diffpipe.training import load
from diffpipe.training.precision import resolve_precision
from diffpipe.utils import stable_json

GiB = 2**30
# float32 optimizer-state bytes per trainable parameter, by ``train.optimizer``.
_STATE_BYTES = {"adamw": 8, "adamw_kahan": 10, "adamw_stochastic": 8, "adafactor": 0, "sgd": 4}  # kahan: bf16 compensation


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU, with what they were computed for."""

    model: str
    gpus: int
    zero_stage: int
    precision: str
    resolution: int
    batch_size: int
    rank: int | None  # None: full fine-tuning
    params: int
    trainable: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    #: None where the forward cannot run on ``meta`` tensors (it reads tensor values, e.g. Lumina 2's mask).
    activation_bytes: int | None
    #: True where activations are an upper bound: the forward selects elements by value (``nonzero``:
    #: mixture-of-experts routing, a text mask's real tokens), and on meta every element is assumed kept.
    activation_upper_bound: bool = False
    frames: int = 1
    height: int = 0  # 0: square (``resolution``)
    base_weights: str = "auto"
    activation_checkpointing: bool = False
    block_swap: int = 0
    #: System RAM holding the swapped blocks' frozen weights (``train.block_swap``).
    cpu_bytes: int = 0
    #: Frozen bytes of each repeated block in call order (what block swap can move), before swapping.
    block_bytes: tuple[int, ...] = ()
    #: System RAM holding the saved activations (``train.activation_offload``; 0: off).
    activation_cpu_bytes: int = 0
    #: What the load's peaks come from: the frozen weights as stored (every block), the whole model and its
    #: largest tensor at the load dtype, and whether it streams (``diffpipe.training.load``).
    frozen_bytes: int = 0
    load_whole_bytes: int = 0
    load_largest_bytes: int = 0
    load_streamed: bool = True
    optimizer: str = "adamw"
    #: ``train.optimizer_in_backward``: each parameter stepped in the backward pass, one gradient held at a time.
    optimizer_in_backward: bool = False

    def swapped(self, n: int) -> MemoryEstimate:
        """This estimate with the last ``n`` blocks swapped (all if fewer): their frozen weights move to
        CPU memory, and the two largest of them count, resident: the block that runs and the next one,
        whose copy is prefetched meanwhile (``training.offload``)."""
        moved = self.block_bytes[len(self.block_bytes) - min(n, len(self.block_bytes)):] if n else ()
        gpus = self.gpus if self.zero_stage == 3 else 1
        resident = sum(sorted(moved)[-2:])
        return replace(self, block_swap=n, cpu_bytes=sum(moved),
                       param_bytes=self.param_bytes - (sum(moved) - resident) // gpus)

    def swap_to_fit(self, budget: int) -> int | None:
        """The fewest blocks to swap for ``total_bytes <= budget``; None if swapping all is not enough."""
        for n in range(len(self.block_bytes) + 1):
            if self.swapped(n).total_bytes <= budget:
                return n
        return None

    @property
    def load_ram_bytes(self) -> int:
        """System RAM at the load's peak, for the ``gpus`` processes of one machine (each loads its copy)."""
        return self._load().ram * self.gpus

    @property
    def load_gpu_bytes(self) -> int:
        """GPU memory at the load's peak (before ZeRO-3 partitions anything)."""
        return self._load().gpu

    def _load(self) -> load.LoadPeak:
        return load.load_peak(stored=self.frozen_bytes, whole=self.load_whole_bytes, swapped=self.cpu_bytes,
                              largest=self.load_largest_bytes, kind=self.base_weights, streamed=self.load_streamed)

    @property
    def total_bytes(self) -> int:
        """Parameters + gradients + optimizer state + activations (those that could be measured)."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + (self.activation_bytes or 0)

    def as_dict(self) -> dict:
        out = {**asdict(self), "total_bytes": self.total_bytes, "load_ram_bytes": self.load_ram_bytes,
               "load_gpu_bytes": self.load_gpu_bytes}
        out.pop("block_bytes")
        return out

    def table(self) -> str:
        """A plain-text summary, one line per part, in GiB."""
        what = f"LoRA rank {self.rank}" if self.rank else "full fine-tuning"
        rows = [
            f"model {self.model}: {self.params / 1e9:.3f}B parameters, {self.trainable / 1e6:.2f}M trainable ({what})",
            f"{self.gpus} GPU(s), ZeRO {self.zero_stage}, {self.precision}, batch {self.batch_size} per GPU "
            f"at {self.resolution}x{self.height or self.resolution} px" + (f" x {self.frames} frames" if self.frames > 1 else ""),
            f"base weights {self.base_weights}, activation checkpointing {'on' if self.activation_checkpointing else 'off'}"
            + (f", {self.block_swap} blocks swapped ({self.cpu_bytes / GiB:.2f} GiB in CPU memory)"
               if self.block_swap else "")
            + (f", activations offloaded ({self.activation_cpu_bytes / GiB:.2f} GiB in CPU memory)"
               if self.activation_cpu_bytes else ""),
            f"optimizer {self.optimizer}" + (", stepped in the backward pass (one gradient at a time)"
                                              if self.optimizer_in_backward else ""),
            f"  parameters       {self.param_bytes / GiB:8.2f} GiB",
            f"  gradients        {self.grad_bytes / GiB:8.2f} GiB",
            f"  optimizer state  {self.optimizer_bytes / GiB:8.2f} GiB",
            f"  activations      {self.activation_bytes / GiB:8.2f} GiB"
            + (" (upper bound: every token kept where the forward selects by value)"
               if self.activation_upper_bound else "")
            if self.activation_bytes is not None
            else "  activations      not measurable on the meta device (the forward reads tensor values or opens autocast on their device)",
            f"  total per GPU    {self.total_bytes / GiB:8.2f} GiB (plus 1-2 GiB CUDA context and fragmentation)",
            f"  load peak        {self.load_gpu_bytes / GiB:8.2f} GiB GPU, {self.load_ram_bytes / GiB:.2f} GiB system "
            f"RAM ({'streamed tensor by tensor' if self.load_streamed else 'loaded whole'})",
        ]
        return "\n".join(rows)


def _model_spec(cfg: Config, model: str | None) -> Published:
    """The published model to size: named, the local folder's config, or the family's flagship."""
    family = cfg.model.family
    fam = get_family(cfg.model)
    variant = getattr(fam, "variant", None)
    if model:
        spec = PUBLISHED.get(model)
        if spec is None:
            raise ValueError(f"--model: unknown published model {model!r}; known: {', '.join(sorted(PUBLISHED))}")
        if spec.family != family:
            raise ValueError(f"--model {model!r} is a {spec.family!r} model, but model.family is {family!r}")
        if not fam.sizes(spec):
            fits = [s.name for s in for_family(family) if fam.sizes(s)]
            raise ValueError(f"--model {model!r} is {family} variant {spec.variant}, whose inputs model.variant "
                             f"{variant} does not take; set model.variant: {spec.variant}"
                             + (f", or name {' or '.join(fits)}" if fits else ""))
        return spec
    # The flagship of this variant's weights, else the first that takes its inputs.
    specs = sorted((s for s in for_family(family) if fam.sizes(s)), key=lambda s: s.variant not in fam.published_variants)
    if not specs:
        raise ValueError(f"model.family {family!r}" + (f" variant {variant}" if variant else "")
                         + ": no published configuration to size; pass a local model")
    if cfg.model.flavor != "local":
        return specs[0]
    cls = getattr(diffusers, specs[0].cls)
    config = dict(cls.load_config(fam.cfg.path, subfolder=fam.denoiser_attr))  # a hub id: its snapshot
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    # Text shapes and latent geometry come from the published model the folder's config is
    # closest to (e.g. SD 2.1 rather than 1.5 for a 1024-wide cross-attention UNet).
    def agreement(spec: Published) -> int:
        return sum(json.dumps(config.get(k)) == json.dumps(v) for k, v in spec.config.items())

    near = max(specs, key=agreement)
    return Published(cfg.model.path, family, near.cls, config, 0, 1, "local folder", near.text,
                     near.latent_channels, near.vae_factor)


def _meta_inputs(spec: Published, batch: int, width: int, height: int, latent_frames: int, dtype: torch.dtype):
    w, h = width // spec.vae_factor, height // spec.vae_factor
    with torch.device("meta"):
        latents = torch.empty(batch, spec.latent_channels, latent_frames, h, w)
        text = {k: torch.empty(batch, *shape, dtype=dtype) for k, shape in spec.text.items()}
        t = torch.full((batch,), 0.5)
        noise = latents.clone() if latent_frames > 1 else torch.empty(batch, spec.latent_channels, h, w)
    return latents, text, t, noise


class Sizes(TypedDict, total=False):
    """What an estimate sizes for, beside the config: the arguments of :func:`estimate_for`."""

    gpus: int
    resolution: int | None
    rank: int | None
    frames: int | None
    height: int | None


def estimate_memory(cfg: Config, *, model: str | None = None, reuse: Reuse | None = None,
                    **sizes: Unpack[Sizes]) -> MemoryEstimate:
    """Memory per GPU to train ``cfg`` on ``gpus`` data-parallel GPUs (default 1; see the module docstring).

    ``resolution`` (pixels; default: the largest dataset resolution), ``rank``
    (default: ``train.lora.rank``), ``model`` (a name in
    ``diffpipe.families.published``; default: the local folder's config, else the
    family's flagship), ``frames`` (video families; default: the largest
    dataset frame bucket, else 1) and ``height`` (default: ``resolution``,
    square; ``resolution`` is then the width) override the config. ``reuse``
    shares the meta denoisers and traced forwards with other estimates (:mod:`diffpipe.meta_denoiser`).
    """
    return estimate_for(cfg, _model_spec(cfg, model), reuse=reuse, **sizes)


def estimate_for(
    cfg: Config,
    spec: Published,
    *,
    gpus: int = 1,
    resolution: int | None = None,
    rank: int | None = None,
    frames: int | None = None,
    height: int | None = None,
    reuse: Reuse | None = None,
) -> MemoryEstimate:
    """:func:`estimate_memory` for a given denoiser configuration (e.g. a published one at reduced depth)."""
    if gpus < 1:
        raise ValueError(f"--gpus must be at least 1, got {gpus}")
    if reuse is None:  # nothing to share: what this estimate builds is freed when it returns
        with Reuse() as own:
            return estimate_for(cfg, spec, gpus=gpus, resolution=resolution, rank=rank, frames=frames,
                                height=height, reuse=own)
    tc = cfg.train
    # The tiny scheduler's prediction type need not suit the folder's zero-terminal-SNR schedule.
    sizing = cfg.model.model_copy(update={"flavor": "tiny", "path": None, "zero_terminal_snr": None})
    family = get_family(sizing)
    family.check_token_routing(tc.token_routing)
    resolution, height, frames = _sizes(cfg, family, spec, resolution, height, frames)
    precision = resolve_precision(tc.precision, cuda=True)  # the estimate is for a GPU: auto = bf16
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    width = 2 if precision == "bf16" else 4

    meta = reuse.denoiser(_build(family, spec, tc, rank, dtype), tc.base_weights)
    param_bytes, grad_bytes, optimizer_bytes = _state_bytes(tc, precision, gpus, meta.frozen_bytes,
                                                            list(meta.sizes), width)
    forward = Forward(sizing, tc.batch_size, resolution, height, frames,
                      max((d.references for d in cfg.datasets), default=0) or 1,  # Qwen-Image-Edit-Plus: up to 4
                      tc.objective, tc.token_routing, tc.activation_checkpointing and meta.checkpointable,
                      tc.checkpoint_fraction)
    activation_bytes, offloaded, upper_bound = _activations(reuse, meta, family, spec, forward, dtype,
                                                            offload=tc.activation_offload)
    load_width = load_dtype(cfg.model, "denoiser", cuda=True).itemsize
    return MemoryEstimate(
        model=spec.name, gpus=gpus, zero_stage=tc.zero_stage, precision=precision, resolution=resolution,
        batch_size=tc.batch_size, rank=meta.rank, params=meta.params, trainable=sum(meta.sizes),
        param_bytes=param_bytes, grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes,
        activation_bytes=activation_bytes, activation_upper_bound=upper_bound, frames=frames,
        base_weights=tc.base_weights, activation_checkpointing=forward.checkpointing, height=height,
        block_bytes=meta.block_bytes, activation_cpu_bytes=offloaded, frozen_bytes=meta.frozen_bytes,
        load_whole_bytes=meta.params * load_width, load_largest_bytes=meta.largest * load_width,
        load_streamed=load.streams(get_family(cfg.model), tc), optimizer=tc.optimizer,
        optimizer_in_backward=tc.optimizer_in_backward,
    ).swapped(tc.block_swap)


def _sizes(cfg: Config, family: Family, spec: Published, resolution: int | None, height: int | None,
           frames: int | None) -> tuple[int, int, int]:
    """Width, height and pixel frames to size for (the config's largest by default), checked against the model."""
    resolution = resolution or max(max(d.resolutions or [d.resolution]) for d in cfg.datasets)
    height = height or resolution
    for side in (resolution, height):
        if side % family.pixel_multiple and side % (spec.vae_factor * 2):
            raise ValueError(f"resolution {side} is not a multiple of {spec.vae_factor * 2}")
    if family.is_video:
        frames = frames or max((max(d.frame_buckets or [1]) for d in cfg.datasets), default=1)
    frames = frames or 1
    step = _frame_step(family)
    if (frames - 1) % step:
        raise ValueError(f"--frames {frames}: family {family.name!r} takes {step}k+1 frames")
    return resolution, height, frames


def _frame_step(family: Family) -> int:
    return family.frame_rule[0] if family.is_video else 1


def _build(family: Family, spec: Published, tc: TrainConfig, rank: int | None, dtype: torch.dtype) -> Build:
    """The meta denoiser to count: the whole one trained, or a LoRA of ``rank`` (default ``train.lora.rank``)
    on the family's targets; fp8 or int8 base weights change its layers (:func:`meta_denoiser.module_kind`)."""
    what = Trainable(None) if tc.mode == "full" else Trainable(rank or tc.lora.rank,
                                                               tuple(family.lora_targets(tc.lora.targets)))
    return Build(spec, dtype, what, module_kind(tc.base_weights, what))


def _state_bytes(tc: TrainConfig, precision: str, gpus: int, frozen_bytes: int, sizes: list[int],
                 width: int) -> tuple[int, int, int]:
    """Bytes per GPU of the weights, the gradients and the optimizer state, as the ZeRO stage partitions them
    (``sizes``: the element count of each trainable tensor)."""
    z, trainable = tc.zero_stage, sum(sizes)
    param_bytes = (frozen_bytes + trainable * width) // (gpus if z == 3 else 1)
    grad_bytes = trainable * width // (gpus if z >= 2 else 1)
    if tc.optimizer_in_backward:  # one gradient at a time: the largest is the peak
        grad_bytes = max(sizes, default=0) * width
    own_bf16 = tc.optimizer in BF16_OPTIMIZERS or tc.optimizer_in_backward
    if precision == "bf16" and z == 0 and not own_bf16:
        # Without ZeRO, DeepSpeed's bf16 wrapper copies every gradient to float32 for its master copy at the step.
        grad_bytes += 4 * trainable
    # bf16: DeepSpeed's float32 master copy, except where the bf16 weights are stepped themselves.
    master = precision == "bf16" and not own_bf16
    if tc.optimizer in QUANTISED_OPTIMIZERS:
        # The moments take the dtype of what is stepped: the float32 master copy, else the weights.
        state = sum(quantised_state_bytes(n, tc.optimizer, 4 if master else width,
                                          tc.optimizer_args.get("block_size")) for n in sizes) + 4 * master * trainable
        state += _STEP_WORKSPACE[tc.optimizer] * max(sizes, default=0)
    else:
        state = trainable * (_STATE_BYTES.get(tc.optimizer.lower(), 8) + 4 * master)
    optimizer_bytes = 0 if tc.offload_optimizer else state // (gpus if z >= 1 else 1)
    return param_bytes, grad_bytes, optimizer_bytes


#: Transient bytes per value while torchao steps one quantised tensor (its compiled step materialises the new
#: moments in float32 before quantising them, and more for 4-bit packing), measured on CPU (torch 2.13,
#: torchao 0.18) on a 3072 x 15360 bf16 tensor: 8.0 and 26.1. Counted once, for the largest tensor.
_STEP_WORKSPACE = {"adamw8bit": 8, "adamw4bit": 26}
#: torchao's block sizes and code bits per value for ``adamw8bit`` / ``adamw4bit`` (their defaults).
_QUANTISED_LAYOUT = {"adamw8bit": (256, 8), "adamw4bit": (128, 4)}


def quantised_state_bytes(numel: int, optimizer: str, width: int, block_size: int | None = None) -> int:
    """Bytes of torchao's two AdamW moments for one tensor of ``numel`` values stepped at ``width`` bytes:
    codes plus a float32 scale per block and the code table where the tensor is quantised (4096+ values, a
    multiple of the block), else two full-width moments."""
    default_block, bits = _QUANTISED_LAYOUT[optimizer]
    block = int(block_size or default_block)
    if numel < 4096 or numel % block:
        return 2 * numel * width
    table = 4 * 2**bits  # the code -> value map, float32
    return 2 * (numel * bits // 8 + 4 * (numel // block) + table)




@dataclass(frozen=True)
class Forward:
    """The training forward an estimate traces: what its saved activations depend on beside the denoiser."""

    model: ModelConfig  # the model section the loss comes from (its family, as sized: tiny flavor)
    batch: int
    width: int
    height: int
    frames: int  # pixel frames
    references: int  # edit families: reference images the size of the target
    objective: ObjectiveConfig
    routing: TokenRoutingConfig | None
    checkpointing: bool
    fraction: float  # train.checkpoint_fraction

    def key(self) -> str:
        """Everything the trace reads, as text (:meth:`Reuse.traced`); not checkpointing: one trace counts the
        saves with it and without (:func:`diffpipe.saved_activations.saved_bytes_each`)."""
        dump = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "checkpointing"}
        for name in ("model", "objective", "routing"):
            dump[name] = None if dump[name] is None else dump[name].model_dump(mode="json")
        return stable_json(dump)


def _meta_forward(family: Family, spec: Published, denoiser: torch.nn.Module, fw: Forward,
                  dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    """One training forward (the loss) of a batch of meta tensors at these sizes."""
    latent_frames = (fw.frames - 1) // _frame_step(family) + 1
    latents, text, t, noise = _meta_inputs(spec, fw.batch, fw.width, fw.height, latent_frames, dtype)
    generator = torch.Generator()
    # Edit families: a reference image the size of the target (the usual case), as conditioning latents.
    extra = family.estimate_controls(latents, denoiser, fw.references) if family.uses_control else {}

    r = fw.routing  # the routed blocks save their activations for the kept tokens only

    def forward() -> torch.Tensor:
        route = None if r is None else TokenRoute(r.keep, r.start_block, r.end_block, torch.Generator())
        return family.loss(denoiser, latents, text, generator, t=t, noise=noise, objective=fw.objective,
                           route=route, **extra)

    return forward


def _activations(reuse: Reuse, meta: MetaDenoiser, family: Family, spec: Published, fw: Forward,
                 dtype: torch.dtype, *, offload: bool) -> tuple[int | None, int, bool]:
    """Saved activation bytes ``(on the device or None when a forward cannot run on meta, in CPU memory,
    whether the figure is an upper bound)``, the workspace of ``meta`` included. Each forward is traced once
    per ``reuse``, counted with checkpointing and without (offload only moves what it saved)."""
    ways = [False, True] if meta.checkpointable else [False]

    def trace(denoiser: torch.nn.Module) -> tuple[list[tuple[int, int]], bool] | None:
        forward = _meta_forward(family, spec, denoiser, fw, dtype)
        return _trace(denoiser, forward, [(checkpointing, fw.fraction) for checkpointing in ways])

    traced = reuse.traced(meta, fw.key(), trace)
    if traced is None:
        return None, 0, False
    counts, upper_bound = traced
    held, largest = counts[ways.index(fw.checkpointing)]
    device, cpu = placed(held, largest, checkpointing=fw.checkpointing, offload=offload)
    return device + meta.workspace, cpu, upper_bound


def _trace(denoiser: torch.nn.Module, forward: Callable[[], torch.Tensor],
           ways: list[tuple[bool, float]]) -> tuple[list[tuple[int, int]], bool] | None:
    """What ``forward`` saves for backward under each ``(checkpointing, fraction)`` of ``ways``
    (:func:`diffpipe.saved_activations.saved_bytes_each`), and whether the figures are upper bounds; None when
    it cannot run on meta."""

    def measure() -> list[tuple[int, int]]:
        return saved_bytes_each(denoiser, forward, ways)

    try:
        return measure(), False
    except NotImplementedError as err:
        if "nonzero" in str(err):
            # Mixture-of-experts routing (HiDream) and boolean-mask indexing (HunyuanImage's text and its
            # padding, reordered) select with ``nonzero``: on meta, assume every element is selected, an
            # upper bound on what the real selection keeps.
            with fx_config.patch(meta_nonzero_assume_all_nonzero=True):
                return measure(), True
        # else: "Cannot copy out of meta tensor": the forward reads tensor values (Lumina 2's mask)
    except RuntimeError as err:
        # Mochi's rotary embedding opens an enabled torch.autocast on its tensors' device: not on meta (a
        # disabled one is a no-op there, saved_activations._meta_autocast_disabled; the error may come from inside autocast).
        # A forward that branches on a tensor's value (HunyuanVideo 1.5's all-zero image embeddings) cannot
        # run on meta either: its activations stay unmeasured, as for Lumina 2's mask above.
        reads_value = "cannot be called on meta tensors" in str(err)
        if not reads_value and "autocast" not in str(err) and not _raised_in(err, "autocast_mode.py"):
            raise
    return None


def _raised_in(err: BaseException, filename: str) -> bool:
    """Whether the innermost frame of ``err``'s traceback is in a file of this name."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.endswith(filename)
