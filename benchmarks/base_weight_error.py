"""Error of the frozen-weight storages: plain float8 cast, scaled fp8 (``base_weights: fp8``), int8, nf4.

Usage (figures in docs/benchmarks.md, "Base-weight storage error"):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/base_weight_error.py [--width 3072]

For a ``width x width`` Linear with weights drawn the way a trained transformer's are spread (a
heavy-tailed body, rows of different magnitude; three overall scales, since a 12B model's layers differ by
an order of magnitude), prints for each storage the relative weight error ``|W' - W| / |W|``, the share of
weights below e4m3's smallest normal (2^-6) and the relative output error ``|x W'^T - x W^T| / |x W^T|``
for bf16 inputs. Then the tiny SD UNet's loss on one fixed batch, each storage against bf16 (LoRA
added, nothing trained): the same forward ``diffpipe train`` runs. torchao does int8 and nf4 here, as in
training; the plain cast is what ``base_weights: fp8`` did before it was scaled.
"""

from __future__ import annotations

import argparse

import peft
import torch

from diffpipe.config import ModelConfig, TrainConfig
from diffpipe.families import get_family
from diffpipe.training import adapter, precision


def trained_like(width: int, std: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    body = torch.randn(width, width, generator=g) * torch.rand(width, width, generator=g).add(0.1).pow(3)
    rows = torch.exp(torch.randn(width, 1, generator=g) * 0.7)
    w = body * rows
    return (w * (std / w.std())).to(torch.bfloat16)


def stored(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """The weight as the storage gives it back to the matmul, in bf16."""
    if kind == "bf16":
        return weight
    if kind == "fp8 (plain cast)":
        return weight.to(torch.float8_e4m3fn).to(torch.bfloat16)
    if kind == "fp8 (scaled)":
        codes, scale = precision.scaled_fp8(weight)
        return precision.dequantise_fp8(codes.view(torch.uint8), scale.view(torch.uint16), torch.bfloat16)
    layer = torch.nn.Sequential(torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False))
    layer[0].weight.data = weight.clone()
    layer.requires_grad_(False)
    precision.enable_quantised_base_weights(layer, torch.bfloat16, kind)
    return layer(torch.eye(weight.shape[1], dtype=torch.bfloat16)).T.contiguous()


KINDS = ("fp8 (plain cast)", "fp8 (scaled)", "int8", "nf4")


def layer_table(width: int) -> None:
    x = torch.randn(64, width, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    print(f"Linear {width}x{width}, bf16 inputs (64 rows):\n")
    print("| weight std | under 2^-6 | storage | weight error | output error |")
    print("| --- | --- | --- | --- | --- |")
    for std in (0.02, 0.005, 0.001):
        w = trained_like(width, std)
        ref = (x.float() @ w.float().T)
        small = float((w.float().abs() < 2**-6).float().mean())
        for kind in KINDS:
            q = stored(w, kind).float()
            werr = float((q - w.float()).norm() / w.float().norm())
            oerr = float((x.float() @ q.T - ref).norm() / ref.norm())
            print(f"| {std} | {small:.0%} | {kind} | {werr:.2%} | {oerr:.2%} |")


def tiny_losses() -> None:
    family = get_family(ModelConfig(family="sd"))
    latents = torch.randn(4, 4, 1, 16, 16, generator=torch.Generator().manual_seed(2))
    text = {"prompt_embeds": torch.randn(4, 77, 32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)}
    losses = {}
    for kind in ("auto", "fp8", "int8", "nf4"):
        unet = family.load_denoiser()
        adapter.add_lora(unet, peft.LoraConfig(r=4, lora_alpha=4, target_modules=family.lora_targets(None)))
        unet.to(torch.bfloat16)
        precision.prepare_denoiser(unet, TrainConfig(precision="bf16", base_weights=kind))
        with torch.no_grad():
            losses[kind] = float(family.loss(unet, latents, text, torch.Generator().manual_seed(0)).mean())
    print("\nTiny SD UNet, one fixed batch (LoRA added, untrained), loss against bf16:\n")
    print("| base_weights | loss | relative to bf16 |\n| --- | --- | --- |")
    for kind, loss in losses.items():
        print(f"| {'bf16' if kind == 'auto' else kind} | {loss:.5f} | {loss / losses['auto'] - 1:+.3%} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=3072)
    args = ap.parse_args()
    layer_table(args.width)
    tiny_losses()


if __name__ == "__main__":
    main()
