"""Probe: forward and backward of PyTorch SDPA at FLUX.1's 1024-px shape under one backend (argv[1]).

Run each backend in its own process (an illegal memory access poisons the CUDA context), with
CUDA_LAUNCH_BLOCKING=1 so a failing kernel is named where it fails.
"""

import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

name = sys.argv[1]
for length in (4608, 4096 + 256, 4096):
    for layout in ("contiguous", "transposed"):
        shape = (1, 24, length, 128) if layout == "contiguous" else (1, length, 24, 128)
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        qq, kk, vv = (t if layout == "contiguous" else t.transpose(1, 2) for t in (q, k, v))
        choice = torch._fused_sdp_choice(qq, kk, vv)
        try:
            if name == "default":
                out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv)
            else:
                with sdpa_kernel([getattr(SDPBackend, name)]):
                    out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv)
            out.float().sum().backward()
            torch.cuda.synchronize()
            print(f"{name} L={length} {layout} default_choice={choice}: ok", flush=True)
        except Exception as exc:  # noqa: BLE001 - a probe reports every failure and goes on
            print(f"{name} L={length} {layout} default_choice={choice}: {type(exc).__name__}: {str(exc)[:200]}",
                  flush=True)
            if "illegal" in str(exc):
                sys.exit(3)
