"""Training overhead: steady-state step time of ``diffpipe train`` vs a bare PyTorch + PEFT loop.

Usage (figure in docs/benchmarks.md, "Benchmarks"):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/train_step_bench.py [--steps 60] [--rounds 3] [--dir /tmp/tb]

Same process, same tiny SD UNet, same LoRA (rank 8, the family's default
targets), batch 4 of 32x32 latents, AdamW, gradient clipping. The bare loop
holds one batch of tensors in memory and does noise, forward, MSE, backward,
clip, step. ``diffpipe train`` runs in process on a cached 16-image run (the
full loop: DeepSpeed engine, data order, metrics.jsonl, TensorBoard, eval only
at the end). Steady state = wall time between step ``--warmup`` and the last
step but one, divided by the steps. The two alternate for ``--rounds`` rounds
(the machine may be shared) and the median of each is compared.
Target: ratio <= 1.10.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch

from diffpipe.config import LoraConfig, ModelConfig, parse_config
from diffpipe.families import get_family
from diffpipe.paths import RunPaths
from diffpipe.training import adapter
from diffpipe.training.metrics import read_metrics

BATCH, LATENT, RANK = 4, 32, 8


def bare_loop(steps: int, warmup: int) -> float:
    """Seconds per step of a plain PyTorch + PEFT LoRA loop on in-memory tensors."""
    family = get_family(ModelConfig())
    unet = family.load_denoiser()
    params = adapter.add_lora(unet, adapter.peft_config(LoraConfig(rank=RANK, alpha=RANK),
                                                        family.lora_targets(None)))
    unet.train()
    opt = torch.optim.AdamW(params, lr=1e-3)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(BATCH, 4, LATENT, LATENT, generator=g)
    ctx = torch.randn(BATCH, 77, 32, generator=g)
    alphas = family.noise_scheduler().alphas_cumprod
    t_warm = None
    for step in range(steps):
        if step == warmup:
            t_warm = time.perf_counter()
        t = torch.randint(0, 1000, (BATCH,), generator=g)
        noise = torch.randn(x0.shape, generator=g)
        a = alphas[t].reshape(-1, 1, 1, 1)
        noisy = a.sqrt() * x0 + (1 - a).sqrt() * noise
        pred = unet(noisy, t, encoder_hidden_states=ctx, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(pred, noise)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())  # the loop logs the loss too
    return (time.perf_counter() - t_warm) / (steps - warmup)


def prepare_run(root: Path) -> Path:
    """A cached 16-image run (64 px images -> 32x32 latents) and its config."""
    from diffpipe import stages
    from diffpipe.data.dataset.demo import write_demo_dataset

    cfg = base_config(root, steps=1)
    paths = RunPaths(cfg.output_dir)
    if not paths.shard_names():
        write_demo_dataset(root / "data", n=16, size=64)
        stages.prepare_data(cfg, paths, empty_caption=False)
    return root


def base_config(root: Path, steps: int):
    return parse_config({
        "output_dir": str(root / "run"),
        "datasets": [{"name": "bench", "path": str(root / "data"), "resolution": 64}],
        "cache": {"shards": 1},
        "train": {"max_steps": steps, "batch_size": BATCH, "save_every_epochs": 0,
                  "lora": {"rank": RANK, "alpha": RANK}, "eval": {"max_items": 4}},
    })


def diffpipe_loop(root: Path, steps: int, warmup: int) -> tuple[float, float]:
    """Seconds per step of ``diffpipe train`` in steady state, and its logged samples/s."""
    from diffpipe.training.loop import train

    cfg = base_config(root, steps)
    paths = RunPaths(cfg.output_dir)
    shutil.rmtree(paths.train_dir, ignore_errors=True)
    train(cfg, paths, log=lambda *a: None)
    rows = read_metrics(paths.metrics)
    # Up to the last step but one: the last carries the final eval.
    per_step = (rows[-2]["elapsed_s"] - rows[warmup - 1]["elapsed_s"]) / (len(rows) - 1 - warmup)
    return per_step, statistics.median(r["samples_per_s"] for r in rows[warmup:-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/diffpipe-train-bench"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = prepare_run(args.dir)
    bare, ours, sps = [], [], []
    for _ in range(args.rounds):
        bare.append(bare_loop(args.steps, args.warmup))
        t, s = diffpipe_loop(root, args.steps, args.warmup)
        ours.append(t)
        sps.append(s)
    result = {
        "bare_step_s": statistics.median(bare),
        "diffpipe_step_s": statistics.median(ours),
        "ratio": statistics.median(ours) / statistics.median(bare),
        "diffpipe_samples_per_s": statistics.median(sps),
        "rounds": {"bare": bare, "diffpipe": ours},
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
