"""Peak RSS of one training step at real width on CPU, against ``diffpipe estimate``.

Each point builds a published denoiser at its real width but few blocks (FLUX.1-dev with 1 double and
2 single blocks, Wan 14B and Qwen-Image with 2), straight in bf16, adds a rank-16 LoRA, applies the
run's options (fp8, int8 or nf4 base weights, activation checkpointing) and trains one step through the code
``diffpipe train`` runs (``Trainable``, ``precision.prepare_denoiser``, the DeepSpeed engine with bf16,
``family.loss``, ``engine.backward`` and ``step``). Its peak resident memory (``VmHWM``) less the
process's memory after the imports is compared with ``estimate_for`` of the same reduced model; the peak
is reset after the set-up, so it is the step's (``diffpipe train`` builds and quantises the weights in CPU
memory, then moves them to the GPU). On CPU
the weights, activations and optimizer state of the step live in RAM, so the peak is a proxy for the
GPU's. Every point runs in a fresh process, one after the other:

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/real_width_memory.py --resolution 512
    .venv/bin/python benchmarks/real_width_memory.py --point flux bf16 512   # one point, JSON

Full fine-tuning points (``full+...``, model ``flux-full``: FLUX.1-dev with 1 double and 1 single block,
every weight trained in bf16) take two steps and measure the second: the optimizer creates its states in the
first, and torchao compiles its step there (the compiler's own memory is no training memory). They cover
torchao's 8-bit and 4-bit AdamW states under DeepSpeed's bf16 mode (float32 master copies) and stepped in the
backward pass on the bf16 weights (``optimizer_in_backward``: one gradient at a time):

    .venv/bin/python benchmarks/real_width_memory.py --families flux-full --options full+8bit,full+8bit+inb,full+4bit+inb

Not counted by the estimate, and so part of the difference: the backward pass's temporaries, the
allocator's slack, the CPU attention kernel's workspace.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MODELS = {  # family -> (published model, config overrides that reduce the depth)
    "flux": ("flux1-dev", {"num_layers": 1, "num_single_layers": 2}),
    "qwenimage": ("qwen-image", {"num_layers": 2}),
    "wan": ("wan2.2-t2v-a14b", {"num_layers": 2}),
    "flux-full": ("flux1-dev", {"num_layers": 1, "num_single_layers": 1}),  # full fine-tuning: every weight trains
}
_FULL = {"mode": "full", "grad_clip": 0}
_IN_BACKWARD = {**_FULL, "optimizer_in_backward": True}
OPTIONS = {
    "bf16": {},
    "fp8": {"base_weights": "fp8"},
    "fp8+ckpt": {"base_weights": "fp8", "activation_checkpointing": True},
    "int8": {"base_weights": "int8"},
    "int8+ckpt": {"base_weights": "int8", "activation_checkpointing": True},
    "nf4": {"base_weights": "nf4"},
    "nf4+ckpt": {"base_weights": "nf4", "activation_checkpointing": True},
    "full+adamw": _FULL,
    "full+8bit": {**_FULL, "optimizer": "adamw8bit"},
    "full+8bit+inb": {**_IN_BACKWARD, "optimizer": "adamw8bit"},
    "full+4bit+inb": {**_IN_BACKWARD, "optimizer": "adamw4bit"},
    "full+kahan+inb": {**_IN_BACKWARD, "optimizer": "adamw_kahan"},
}


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def point(family: str, option: str, resolution: int, frames: int, height: int) -> dict:
    """One training step in this process; returns measured and estimated bytes."""
    import dataclasses

    import torch

    from diffpipe.config import Config
    from diffpipe.estimate import estimate_for
    from diffpipe.families import get_family
    from diffpipe.families.published import PUBLISHED
    from diffpipe.training import engine, precision
    from diffpipe.training.optim import build_training_optimizer
    from diffpipe.training.trainable import Trainable

    name, reduce = MODELS[family]
    spec = PUBLISHED[name]
    spec = dataclasses.replace(spec, name=f"{name} (reduced)", config={**spec.config, **reduce})
    cfg = Config.model_validate({
        "model": {"family": family.removesuffix("-full")}, "datasets": [{"name": "d", "path": "data", "resolution": resolution}],
        "train": {"batch_size": 1, "precision": "bf16", "lora": {"rank": 16, "alpha": 16}, **OPTIONS[option]}})
    fam = get_family(cfg.model.model_copy(update={"flavor": "tiny"}))
    dist = engine.setup_distributed()
    estimate = estimate_for(cfg, spec, resolution=resolution, frames=frames, height=height)
    import gc

    gc.collect()
    baseline = _rss("VmRSS")
    import diffusers

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built straight in bf16: no fp32 copy
    try:
        denoiser = getattr(diffusers, spec.cls)(**spec.config)
    finally:
        torch.set_default_dtype(default)
    trained = Trainable(denoiser, fam, cfg, is_main=True)
    precision.prepare_denoiser(denoiser, cfg.train)
    optimizer = build_training_optimizer(trained.param_groups(), cfg.train)
    model = engine.build_engine(denoiser, optimizer, None, cfg.train, dist.world_size)
    full = cfg.train.mode == "full"
    w, h = resolution // spec.vae_factor, height // spec.vae_factor
    step = fam.frame_rule[0] if fam.is_video else 1
    latents = torch.randn(1, spec.latent_channels, (frames - 1) // step + 1, h, w)
    text = {k: torch.randn(1, *shape) for k, shape in spec.text.items()}
    if "prompt_embeds_mask" in text:
        text["prompt_embeds_mask"] = torch.ones(1, *spec.text["prompt_embeds_mask"], dtype=torch.long)
    for _ in range(2 if full else 1):  # full: the second step (see the module docstring)
        gc.collect()
        # The step's peak, not the set-up's: the weights are built in bf16 before nf4 quantises them, as
        # ``diffpipe train`` loads them in CPU memory before moving the quantised model to the GPU. Writing 5
        # to clear_refs resets VmHWM to the current RSS (Linux 4.0+).
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _rss("VmRSS")
        start = time.perf_counter()
        loss = fam.loss(model.module, latents, text, torch.Generator().manual_seed(0), t=torch.tensor([0.5])).mean()
        model.backward(loss)
        model.step()
        seconds = time.perf_counter() - start
    peak = _rss("VmHWM")
    return {"family": family, "option": option, "resolution": resolution, "height": height, "frames": frames,
            "measured_bytes": peak - baseline, "estimate_bytes": estimate.total_bytes,
            "estimate": estimate.as_dict(), "seconds": round(seconds, 1), "loss": loss.item(),
            # What was resident before the measured step, and how much of it is tensors (weights, optimizer
            # states, float32 master copies): the rest is the process's own (for full points, the compiler's).
            "held_before_step_bytes": before - baseline, "tensor_bytes": _tensor_bytes(model)}


def _tensor_bytes(model) -> int:
    """Bytes of the module's parameters, the optimizer's states (a quantised state's codes, scales and code
    table) and DeepSpeed's float32 master copies, each storage once."""
    import torch

    seen: dict[int, int] = {}

    def add(t) -> None:
        if hasattr(t, "__tensor_flatten__") and not isinstance(t, torch.nn.Parameter):
            for name in t.__tensor_flatten__()[0]:
                add(getattr(t, name))
        elif isinstance(t, torch.Tensor) and t.device.type == "cpu":
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for param in model.module.parameters():
        add(param)
    basic = getattr(model, "basic_optimizer", None) or model.optimizer
    for opt in getattr(basic, "optimizers", [basic]):  # optimizer_in_backward: one per parameter
        for state in opt.state.values():
            for value in state.values():
                add(value)
    for group in getattr(model.optimizer, "fp32_groups", []):  # DeepSpeed's bf16 wrapper: float32 masters
        for master in group:
            add(master)
    return sum(seen.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--point", nargs=3, metavar=("FAMILY", "OPTION", "RESOLUTION"))
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--frames", type=int, default=9, help="Wan: pixel frames at 832x480 (9 keeps bf16 under 5 GiB)")
    ap.add_argument("--families", default=",".join(MODELS))
    ap.add_argument("--options", default=",".join(OPTIONS))
    args = ap.parse_args()
    if args.point:
        family, option, res = args.point
        video = family == "wan"  # 480p: 832x480
        print(json.dumps(point(family, option, 832 if video else int(res), args.frames if video else 1,
                               480 if video else int(res))))
        return
    rows = ["| model (reduced depth) | size | option | measured peak RSS | estimate | estimate / measured | step |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for family in args.families.split(","):
        for option in args.options.split(","):
            # A fixed mmap threshold: glibc then maps every large tensor on its own and returns it when
            # freed, so RSS follows the live tensors (its default heap keeps freed chunks: +1.3 GiB here).
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
            out = subprocess.run([sys.executable, __file__, "--point", family, option, str(args.resolution),
                                  "--frames", str(args.frames)], capture_output=True, text=True, env=env)
            if out.returncode:
                print(out.stderr[-3000:], file=sys.stderr)
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            gib = 2**30
            size = f"{r['resolution']}x{r['height']} px" + (f" x {r['frames']} frames" if r["frames"] > 1 else "")
            rows.append(f"| {MODELS[family][0]} {MODELS[family][1]} | {size} | {option} | "
                        f"{r['measured_bytes'] / gib:.2f} GiB | {r['estimate_bytes'] / gib:.2f} GiB | "
                        f"{r['estimate_bytes'] / r['measured_bytes']:.2f} | {r['seconds']} s |")
            print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
