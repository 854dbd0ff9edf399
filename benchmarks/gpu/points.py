"""Checks b, d, e: LoRA training steps of published denoisers at real width and real depth.

A point builds the published denoiser (FLUX.1-dev, Qwen-Image, Wan 14B) with random weights straight on
the device in bf16, then trains through the code ``diffpipe train`` runs: ``Trainable`` (LoRA rank 16,
activation checkpointing), ``precision.prepare_denoiser`` (fp8 / int8 / nf4 base weights, attention
backend, compile), the DeepSpeed engine, ``offload.install`` (block swap) and the trainer's own step
function (``loop._train_step``) on a one-bucket in-memory dataset of the real latent and text shapes,
with ``StepFlops`` counting the first step's FLOPs. It reports the peak of
``torch.cuda.max_memory_allocated`` over the steps against ``diffpipe estimate`` (``estimate_for``) of
the same config, the median s/step after warm-up, TFLOPS and MFU (against the data-sheet peak that
``diffpipe train`` logs, and against the bf16 matmul rate measured on the device).

Dry run (CPU): the same functions on the same families at tiny width and depth (``DRY``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kit import Run, free_device_memory, is_oom, median, timed

#: family -> (published model, width, height, frames) of the real points.
REAL = {
    "flux": ("flux1-dev", 1024, 1024, 1),
    "qwenimage": ("qwen-image", 1024, 1024, 1),
    "wan": ("wan2.2-t2v-a14b", 832, 480, 33),  # one expert of Wan 2.2 A14B: Wan 2.1 14B's architecture
}
#: family -> (config overrides, text shapes, width, height, frames) of the dry run: tiny width and depth,
#: the published input layout (latent channels, text streams).
DRY = {
    "flux": ({"num_layers": 2, "num_single_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
              "joint_attention_dim": 32, "pooled_projection_dim": 32, "axes_dims_rope": [4, 4, 8]},
             {"prompt_embeds": (8, 32), "pooled_prompt_embeds": (32,)}, 64, 64, 1),
    "qwenimage": ({"num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 32,
                   "axes_dims_rope": [4, 6, 6]}, {"prompt_embeds": (8, 32), "prompt_embeds_mask": (8,)}, 64, 64, 1),
    "wan": ({"num_attention_heads": 2, "attention_head_dim": 12, "ffn_dim": 32, "num_layers": 2, "text_dim": 32},
            {"prompt_embeds": (8, 32)}, 64, 64, 5),
}
#: The run options of check b (``block_swap: half`` swaps half the denoiser's blocks).
OPTIONS: dict[str, dict[str, Any]] = {
    "bf16+ckpt": {"activation_checkpointing": True},
    "fp8+ckpt": {"base_weights": "fp8", "activation_checkpointing": True},
    "int8+ckpt": {"base_weights": "int8", "activation_checkpointing": True},
    "nf4+ckpt": {"base_weights": "nf4", "activation_checkpointing": True},
    "fp8+ckpt+swap_half": {"base_weights": "fp8", "activation_checkpointing": True, "block_swap": "half"},
}


@dataclasses.dataclass
class Shape:
    spec: Any  # diffpipe.models.spec.Published
    width: int
    height: int
    frames: int


def shape_for(family: str, dry: bool) -> Shape:
    from diffpipe.families.published import PUBLISHED

    name, width, height, frames = REAL[family]
    spec = PUBLISHED[name]
    if not dry:
        return Shape(spec, width, height, frames)
    config, text, width, height, frames = DRY[family]
    spec = dataclasses.replace(spec, name=f"{name} (dry run: tiny)", config={**spec.config, **config}, text=text)
    return Shape(spec, width, height, frames)


def config_for(family: str, shape: Shape, train: dict[str, Any]):
    """The run's typed config: LoRA rank 16, batch 1, bf16, ``train`` (``block_swap: half`` resolved)."""
    from diffpipe.config import Config
    from diffpipe.training import offload

    train = dict(train)
    if train.get("block_swap") == "half":
        train["block_swap"] = len(offload.swap_blocks(shape.spec.build_meta())) // 2
    return Config.model_validate({
        "model": {"family": family},
        "datasets": [{"name": "d", "path": "data", "resolution": shape.width}],
        "train": {"batch_size": 1, "precision": "bf16", "lora": {"rank": 16, "alpha": 16}, **train}})


def _dataset(shape: Shape, family):
    """One bucket, one item of the real latent and text shapes (random values: cost depends on shapes)."""
    import torch

    from diffpipe.data.cache.reader import CachedDataset, _Item

    spec = shape.spec
    step = family.frame_rule[0] if family.is_video else 1
    lat = (spec.latent_channels, (shape.frames - 1) // step + 1, shape.height // spec.vae_factor,
           shape.width // spec.vae_factor)
    gen = torch.Generator().manual_seed(0)
    text = {k: torch.randn(1, *s, generator=gen) for k, s in spec.text.items()}
    if "prompt_embeds_mask" in text:
        text["prompt_embeds_mask"] = torch.ones(1, *spec.text["prompt_embeds_mask"], dtype=torch.long)
    bucket = f"bench-{shape.height}x{shape.width}x{shape.frames}"
    items = [_Item(id="bench/0", path="bench/0", bucket=bucket, row=0, text_row=0, repeats=1,
                   sizes=(shape.height, shape.width, 0, 0))]
    empty = {k: v[:1].clone() for k, v in text.items()}
    return CachedDataset(items, {bucket: torch.randn(1, *lat, generator=gen)}, text, empty, shards=[]), bucket


class Point:
    """A denoiser at real size, trained through ``diffpipe train``'s code; :meth:`steps` times its steps."""

    def __init__(self, family_name: str, shape: Shape, cfg):
        import diffusers
        import torch

        from diffpipe.families import get_family
        from diffpipe.training import engine, offload, precision
        from diffpipe.training.flops import StepFlops
        from diffpipe.training.optim import build_optimizer
        from diffpipe.training.trainable import Trainable

        self.cfg, self.tc, self.shape = cfg, cfg.train, shape
        # What earlier points of this process left allocated (if anything): the peak is counted above it.
        self.base = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        self.family = get_family(cfg.model.model_copy(update={"flavor": "tiny"}))
        self.dist = engine.setup_distributed()
        device = engine.device()
        torch.manual_seed(0)
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # built straight in bf16 on the device: no fp32 copy
        try:
            with torch.device(device):
                self.denoiser = getattr(diffusers, shape.spec.cls)(**shape.spec.config)
        finally:
            torch.set_default_dtype(default)
        self.trained = Trainable(self.denoiser, self.family, cfg, is_main=True)
        precision.prepare_denoiser(self.denoiser, self.tc)
        self.denoiser.to(device)
        self.params = self.trained.all_params
        optimizer = build_optimizer(self.trained.param_groups(), self.tc)
        self.model = engine.build_engine(self.trained.training_module(), optimizer, None, self.tc, 1)
        self.swap = offload.install(self.denoiser, self.tc.block_swap, device)  # after DeepSpeed, as the loop does
        self.data, self.bucket = _dataset(shape, self.family)
        self.gen = torch.Generator(device=device).manual_seed(0)
        self.flops = StepFlops(self.tc, device)

    def step(self) -> float:
        """One optimizer step of the trainer's step function; returns its seconds (device synchronised)."""
        from diffpipe.training.loop import _train_step

        with timed() as t, self.flops.step((self.bucket,)):
            loss, _, _ = _train_step(self.model, self.family, self.data, [[0]], self.gen, self.params, 0.0,
                                     self.tc.objective, 0)
            self.loss = float(loss)
        return t()

    def steps(self, run: Run) -> dict[str, Any]:
        """Warm-up steps (the first counts FLOPs), then ``run.steps`` timed ones: the figures of a row."""
        import torch

        free_peak()
        warm = [self.step() for _ in range(run.warmup)]
        times = [self.step() for _ in range(run.steps)]
        s = median(times)
        out: dict[str, Any] = {"s_per_step": s, "step_times": [round(x, 4) for x in times],
                               "warmup_s": [round(x, 3) for x in warm], "loss": self.loss}
        out.update(self.flops.fields(s))
        if torch.cuda.is_available():
            out["peak_bytes"] = torch.cuda.max_memory_allocated() - self.base
            out["allocated_before_bytes"] = self.base
        if self.swap is not None:
            out.update(swapped_blocks=self.tc.block_swap, prefetched=self.swap.prefetched, onloads=self.swap.onloads)
        return out

    def close(self) -> None:
        if self.swap is not None:
            self.swap.remove()
        destroy = getattr(self.model, "destroy", None)
        if destroy is not None:
            destroy()
        self.model = self.denoiser = self.trained = self.params = self.swap = None
        free_device_memory()


def free_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def measure(run: Run, check: str, family: str, option: str, train: dict[str, Any], *, matmul: float | None,
            keep: bool = False) -> tuple[dict[str, Any], Point | None]:
    """Build, train and report one point (a row of ``check``); ``keep``: return the point still built."""
    from diffpipe.estimate import estimate_for

    name = f"{family} {option}"
    shape = shape_for(family, run.dry)
    point = None
    try:
        cfg = config_for(family, shape, train)
        est = estimate_for(cfg, shape.spec, resolution=shape.width, frames=shape.frames, height=shape.height)
        with timed() as setup:
            point = Point(family, shape, cfg)
        fields = {"model": shape.spec.name, "size": f"{shape.width}x{shape.height}x{shape.frames}",
                  "setup_s": round(setup(), 1), **point.steps(run), "estimate_bytes": est.total_bytes}
        fields.update(_ratios(fields, matmul))
        row = run.row(check, name, "dry-run" if run.dry else "ok", **fields)
    except Exception as err:  # noqa: BLE001  (a failed point is a row; the next one runs)
        row = run.row(check, name, "oom" if is_oom(err) else "error", error=f"{type(err).__name__}: {err}"[:2000])
        if point is not None:
            point.close()
        return row, None
    if not keep:
        point.close()
        point = None
    return row, point


def _ratios(f: dict[str, Any], matmul: float | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if f.get("peak_bytes"):
        out["estimate_over_measured"] = f["estimate_bytes"] / f["peak_bytes"]
        out["within_15pct"] = abs(out["estimate_over_measured"] - 1) <= 0.15
    if matmul and f.get("tflops_per_device"):
        out["mfu_vs_measured_matmul"] = f["tflops_per_device"] / matmul
    return out


def check_b(run: Run, matmul: float | None) -> None:
    """FLUX.1-dev at 1024 px: every option of ``OPTIONS``; the swap's step time against fp8 + checkpointing."""
    try:
        swap_matches(run)
    except Exception as err:  # noqa: BLE001
        run.row("b", "block swap prefetch: same step as no swap (tiny flux, every block)", "error",
                error=f"{type(err).__name__}: {err}"[:2000])
    rows = {}
    for option, train in OPTIONS.items():
        if run.left < 30:
            run.skip("b", f"flux {option}", f"no time left ({run.left:.0f} s)")
            continue
        rows[option], _ = measure(run, "b", "flux", option, train, matmul=matmul)
    swap, base = rows.get("fp8+ckpt+swap_half", {}), rows.get("fp8+ckpt", {})
    if swap.get("s_per_step") and base.get("s_per_step"):
        ratio = swap["s_per_step"] / base["s_per_step"]
        goal = {} if run.dry else {"goal": "<= 1.3", "meets_goal": ratio <= 1.3}  # tiny CPU steps prove nothing
        run.row("b", "block swap slowdown", "dry-run" if run.dry else "ok", swap_over_no_swap=ratio, **goal)


#: Attention backends tried in check d besides torch's SDPA (``native``); each one this machine cannot run
#: is skipped by name with ``diffpipe``'s own reason. The dry run adds ``_native_math`` (runs on CPU), so the
#: switching path is exercised there too.
BACKENDS = ["_native_flash", "_native_cudnn", "_native_efficient", "flash", "_flash_3", "sage", "xformers"]


def _backend_problem(tc, name: str) -> str | None:
    from diffpipe.training import precision

    try:
        precision.check(tc.model_copy(update={"attention_backend": name}))
    except ValueError as err:
        return str(err)
    return None


def check_d(run: Run, matmul: float | None) -> None:
    """FLUX.1-dev bf16 + checkpointing: each attention backend and ``train.compile`` against SDPA."""
    from diffpipe.training import precision

    row, point = measure(run, "d", "flux", "bf16+ckpt attention native", OPTIONS["bf16+ckpt"], matmul=matmul,
                         keep=True)
    if point is None:
        return
    base, status = row["s_per_step"], "dry-run" if run.dry else "ok"
    try:
        for name in BACKENDS + (["_native_math"] if run.dry else []):
            if (problem := _backend_problem(point.tc, name)) or run.left < 30:
                run.skip("d", f"flux bf16+ckpt attention {name}", problem or f"no time left ({run.left:.0f} s)")
                continue
            try:
                point.denoiser.set_attention_backend(name)
                f = point.steps(run)
                run.row("d", f"flux bf16+ckpt attention {name}", status, **f, speedup_vs_native=base / f["s_per_step"])
            except Exception as err:  # noqa: BLE001
                run.row("d", f"flux bf16+ckpt attention {name}", "error", error=f"{type(err).__name__}: {err}"[:2000])
        point.denoiser.set_attention_backend("native")
        if run.dry:
            run.skip("d", "flux bf16+ckpt compile", "dry run: train.compile's inductor kernels are measured on CUDA "
                     "only (the CPU test suite compiles with aot_eager)")
        elif run.left < 120:
            run.skip("d", "flux bf16+ckpt compile", f"no time left ({run.left:.0f} s)")
        else:
            precision.compile_blocks(point.denoiser)  # what train.compile: true does
            f = point.steps(run)
            compile_s = sum(f["warmup_s"]) - len(f["warmup_s"]) * f["s_per_step"]
            run.row("d", "flux bf16+ckpt compile", status, **f, speedup_vs_native=base / f["s_per_step"],
                    compile_s=compile_s)
    finally:
        point.close()


#: Check e's points: (family, option name, train settings).
EXTRA = [("qwenimage", "nf4+ckpt", OPTIONS["nf4+ckpt"]), ("wan", "fp8+ckpt+swap_half", OPTIONS["fp8+ckpt+swap_half"])]


def check_e(run: Run, matmul: float | None) -> None:
    """If time is left: Qwen-Image nf4 + checkpointing, Wan 14B 480p x 33 frames fp8 + checkpointing + swap."""
    for family, option, train in EXTRA:
        if run.left < 90:
            run.skip("e", f"{family} {option}", f"no time left ({run.left:.0f} s)")
            continue
        measure(run, "e", family, option, train, matmul=matmul)
    run.skip("e", "flux group-offloaded sampling", "not in this kit yet: it needs FLUX's T5-XXL, CLIP and VAE built "
             "at full size beside the transformer (diffpipe.training.sample's offload path)")


def swap_matches(run: Run) -> None:
    """Check b's first row: a step with every block swapped (side-stream prefetch on CUDA, in-place copies on
    CPU) against the same step without swap, on the tiny Flux with 2 + 3 blocks: loss and LoRA gradients."""
    import copy

    import diffusers
    import peft
    import torch

    from diffpipe.config import ModelConfig
    from diffpipe.families import get_family
    from diffpipe.families.flux.flavors import TINY_TRANSFORMER
    from diffpipe.training import offload

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    family = get_family(ModelConfig(family="flux"))
    torch.manual_seed(0)
    den = diffusers.FluxTransformer2DModel(**{**TINY_TRANSFORMER, "num_layers": 2, "num_single_layers": 3})
    den.requires_grad_(False).add_adapter(peft.LoraConfig(r=4, lora_alpha=4, target_modules=family.lora_targets(None),
                                                          init_lora_weights=False))
    den.enable_gradient_checkpointing()
    den = den.to(device).train()
    ref = copy.deepcopy(den)
    latents = torch.randn(2, 1, 1, 16, 16, device=device)
    text = {"prompt_embeds": torch.randn(2, 8, 32, device=device), "pooled_prompt_embeds": torch.randn(2, 32, device=device)}
    swap = offload.install(den, 1000, device)

    def step(model):
        loss = family.loss(model, latents, text, torch.Generator(device).manual_seed(1)).mean()
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    (loss, grads), (want_loss, want) = step(den), step(ref)
    diff = max([float((loss - want_loss).abs() / want_loss.abs())] +
               [float((grads[k] - want[k]).norm() / want[k].norm().clamp_min(1e-30)) for k in want])
    # CPU: bit for bit. CUDA: some attention backward kernels sum in a run-dependent order.
    ok = diff == 0 if device.type == "cpu" else diff < 1e-5
    run.row("b", "block swap prefetch: same step as no swap (tiny flux, every block)", "ok" if ok else "error",
            copier=type(swap.copier).__name__, max_rel_diff=diff, onloads=swap.onloads, prefetched=swap.prefetched)
    if device.type == "cpu":
        run.skip("b", "block swap side-stream copies (StreamCopier)", "needs CUDA streams: on CPU the same prefetch "
                 "order ran with in-place copies (SyncCopier)")
