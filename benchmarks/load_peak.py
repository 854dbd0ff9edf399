"""Peak system RAM of loading a real-width denoiser for training: loaded whole (``from_pretrained``, then
quantised) against streamed (:mod:`diffpipe.training.load`), each against the estimate's load peak.

Usage (figures in docs/benchmarks.md, "Load peak"):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/load_peak.py [--double 2] [--single 4]

A FLUX.1-width transformer (hidden size 3072, the published config) at reduced depth (``--double`` double
and ``--single`` single blocks) with random bf16 weights is written to a safetensors file in a temporary
folder. Each case then loads it in a fresh process, as ``diffpipe train`` sets it up on a machine without a
GPU (where "the device" is the CPU, so resident weights live in RAM too): bf16, fp8, nf4, and fp8 with block
swap. A process reports its peak RSS (``VmHWM``) less its RSS after the imports (the baseline). The estimate
is :func:`diffpipe.training.load.load_peak` for the same model on a CPU device.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = [("auto", 0), ("fp8", 0), ("nf4", 0), ("fp8", 2)]
GiB = 1024**3


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def write_model(folder: Path, double: int, single: int) -> None:
    """The transformer's config and random bf16 weights, one tensor at a time into one file."""
    import torch
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    config = {"num_layers": double, "num_single_layers": single, "guidance_embeds": True}
    with torch.device("meta"):
        meta = FluxTransformer2DModel(**config)
    (folder / "transformer").mkdir(parents=True)
    meta.save_config(folder / "transformer")
    g = torch.Generator().manual_seed(0)
    tensors = {k: (torch.randn(v.shape, generator=g) * 0.02).to(torch.bfloat16) for k, v in meta.state_dict().items()}
    save_file(tensors, str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))


def child(folder: str, path: str, base_weights: str, swap: int) -> dict:
    """Load as ``path`` (``whole`` or ``streamed``) does; the peak and the estimate, in bytes."""
    import torch

    from diffpipe.config import ModelConfig, TrainConfig
    from diffpipe.families import get_family
    from diffpipe.training import load, offload, precision

    family = get_family(ModelConfig(family="flux", flavor="local", path=folder, dtype="bfloat16"))
    tc = TrainConfig(base_weights=base_weights, precision="bf16", block_swap=swap, activation_checkpointing=bool(swap))
    cpu = torch.device("cpu")
    if base_weights == "nf4":
        import torchao.quantization  # noqa: F401  (its import is part of the baseline, not of the load)
    baseline = _status("VmRSS")
    if path == "whole":
        den = family.load_denoiser()
        den.requires_grad_(False)  # as adding the LoRA leaves it: quantised_layers takes frozen layers only
        precision.prepare_denoiser(den, tc)
        offload.install(den, swap, cpu)
    else:
        den = load.load_denoiser(family, tc, cpu).module
        held = offload.hold(den, swap, cpu)
        offload.install(den, swap, cpu, held=held)
    loaded = _status("VmHWM") - baseline
    # The first forward reads every weight: pages of a memory-mapped file (a bf16 load that casts nothing
    # keeps the file's pages) count from then on.
    for t in [*den.parameters(), *den.buffers()]:
        if type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_floating_point() and t.numel():
            t.detach().reshape(-1)[::1024].sum()
    peak = _status("VmHWM") - baseline
    est = load.estimate_peak(family, tc, device=cpu, streamed=path == "streamed")
    return {"loaded": loaded, "peak": peak, "estimate": est.ram + est.gpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--double", type=int, default=2)
    parser.add_argument("--single", type=int, default=4)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        folder, path, base_weights, swap = args.child
        print(json.dumps(child(folder, path, base_weights, int(swap))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        write_model(Path(tmp), args.double, args.single)
        size = (Path(tmp) / "transformer" / "diffusion_pytorch_model.safetensors").stat().st_size
        print(f"FLUX.1 width, {args.double} double + {args.single} single blocks: {size / GiB:.2f} GiB of bf16")
        print("peak RSS beyond the imports, GiB: at the end of the load / after every weight was read once")
        print(f"{'base weights':<13}{'swap':>5}{'whole':>13}{'streamed':>13}{'ratio':>7}{'estimate':>10}"
              f"{'streamed/est':>14}{'whole/est':>11}")
        for base_weights, swap in CASES:
            got = {}
            for path in ("whole", "streamed"):
                out = subprocess.run([sys.executable, __file__, "--child", tmp, path, base_weights, str(swap)],
                                     capture_output=True, text=True, check=True)
                got[path] = json.loads(out.stdout.strip().splitlines()[-1])
            w, s = got["whole"], got["streamed"]
            name = "bf16" if base_weights == "auto" else base_weights
            print(f"{name:<13}{swap:>5}{_pair(w):>13}{_pair(s):>13}{s['peak'] / w['peak']:>7.2f}"
                  f"{s['estimate'] / GiB:>10.2f}{s['peak'] / s['estimate']:>14.2f}"
                  f"{w['peak'] / w['estimate']:>11.2f}")


def _pair(got: dict) -> str:
    return f"{got['loaded'] / GiB:.2f} / {got['peak'] / GiB:.2f}"


if __name__ == "__main__":
    main()
