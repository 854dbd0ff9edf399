"""Token routing (``train.token_routing``) against no routing: FLOPs and time of a LoRA training step at
FLUX.1's real width on CPU, and the losses of a tiny model trained a fixed number of steps each way.

Step (``--part step``): FLUX.1-dev's published config at its real width (3072, 24 heads, T5 width 4096)
with reduced depth (``--double`` double-stream and ``--single`` single-stream blocks), float32, a rank-16
LoRA on the family's default targets, one batch at ``--resolution`` px and ``--text`` T5 tokens. Each
mode (no routing, then keep 0.5 over blocks ``--start``..``--end``-1) runs a counted step (forward and
backward under diffpipe's FLOP counter) and ``--steps`` timed steps, in the same process; the ratios are
routed / plain.

Loss (``--part loss``): the tiny FLUX.1 flavor widened to 8 blocks (2 double, 6 single), trained with
AdamW (lr 1e-3, rank 8) on 16 fixed random latents and captions for ``--train-steps`` steps, once without
routing and once with keep 0.5 over blocks 1..7, from the same seed; both evaluated on every token at
fixed timesteps and noise (what ``diffpipe train``'s evaluation does).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/token_routing.py --part step
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/token_routing.py --part loss
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from diffpipe.config import LoraConfig, ModelConfig, ObjectiveConfig
from diffpipe.families import get_family
from diffpipe.families.published import PUBLISHED
from diffpipe.models.routing import TokenRoute, routed
from diffpipe.training import adapter
from diffpipe.training.flops import counted


def _flux_step_inputs(resolution: int, text_len: int, g: torch.Generator):
    side = resolution // 8  # FLUX.1's VAE: 8x down, 16 channels
    latents = torch.randn(1, 16, 1, side, side, generator=g)
    text = {"prompt_embeds": torch.randn(1, text_len, 4096, generator=g),
            "pooled_prompt_embeds": torch.randn(1, 768, generator=g)}
    return latents, text


def _step(family, tr, latents, text, route, seed: int) -> float:
    loss = family.loss(tr, latents, text, torch.Generator().manual_seed(seed), objective=ObjectiveConfig(),
                       route=route).mean()
    loss.backward()
    return float(loss)


def measure_step(args) -> dict:
    family = get_family(ModelConfig(family="flux"))
    spec = PUBLISHED["flux1-dev"]
    torch.manual_seed(0)
    tr = type(spec.build_meta())(**{**spec.config, "num_layers": args.double, "num_single_layers": args.single})
    adapter.add_lora(tr, adapter.peft_config(LoraConfig(rank=16), family.lora_targets(None)))
    latents, text = _flux_step_inputs(args.resolution, args.text, torch.Generator().manual_seed(0))
    out = {"model": f"FLUX.1-dev width, {args.double} double + {args.single} single blocks",
           "resolution": args.resolution, "image_tokens": (args.resolution // 16) ** 2, "text_tokens": args.text,
           "routed_blocks": [args.start, args.end], "keep": 0.5}
    for name, keep in (("plain", None), ("routed", 0.5)):
        def route(seed: int, keep=keep):
            return None if keep is None else TokenRoute(keep, args.start, args.end, torch.Generator().manual_seed(seed))

        with counted() as mode:
            _step(family, tr, latents, text, route(0), 0)
        times = []
        for i in range(args.steps):
            t0 = time.perf_counter()
            _step(family, tr, latents, text, route(i + 1), i + 1)
            times.append(time.perf_counter() - t0)
        out[name] = {"flops": mode.get_total_flops(), "step_s": min(times), "times": times}
    out["flops_ratio"] = out["routed"]["flops"] / out["plain"]["flops"]
    out["time_ratio"] = out["routed"]["step_s"] / out["plain"]["step_s"]
    return out


def _tiny(seed: int):
    family = get_family(ModelConfig(family="flux"))
    torch.manual_seed(seed)
    base = family.load_denoiser()
    tr = type(base)(**{**base.config, "num_layers": 2, "num_single_layers": 6})
    params = adapter.add_lora(tr, adapter.peft_config(LoraConfig(rank=8), family.lora_targets(None)))
    return family, tr, params


def measure_loss(args) -> dict:
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(16, 1, 1, 16, 16, generator=g)
    text = {"prompt_embeds": torch.randn(16, 8, 32, generator=g), "pooled_prompt_embeds": torch.randn(16, 32, generator=g)}
    t_eval = torch.linspace(0.1, 0.9, 16)
    noise_eval = torch.randn(16, 1, 16, 16, generator=g)
    out = {"steps": args.train_steps, "batch": 4}
    for name, keep in (("plain", None), ("routed", 0.5)):
        family, tr, params = _tiny(1)
        opt = torch.optim.AdamW(params, lr=1e-3)
        gen = torch.Generator().manual_seed(3)
        t0 = time.perf_counter()
        for step in range(args.train_steps):
            idx = torch.arange(4) + 4 * (step % 4)
            route = None if keep is None else TokenRoute(keep, 1, 7, torch.Generator().manual_seed(step))
            loss = family.loss(tr, latents[idx], {k: v[idx] for k, v in text.items()}, gen, route=route).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        seconds = time.perf_counter() - t0
        with torch.no_grad(), routed(tr, None, None):
            final = family.loss(tr, latents, text, torch.Generator(), t=t_eval, noise=noise_eval).mean()
        out[name] = {"eval_loss": float(final), "train_s": seconds}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["step", "loss"], required=True)
    p.add_argument("--resolution", type=int, default=256)
    p.add_argument("--text", type=int, default=64)
    p.add_argument("--double", type=int, default=1)
    p.add_argument("--single", type=int, default=3)
    p.add_argument("--start", type=int, default=1)
    p.add_argument("--end", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--train-steps", type=int, default=200)
    args = p.parse_args()
    print(json.dumps(measure_step(args) if args.part == "step" else measure_loss(args), indent=1))


if __name__ == "__main__":
    main()
