"""Peak RSS while loading a ComfyUI fp8-scaled FLUX checkpoint as the base, against a bf16 file under fp8.

A ``*_fp8_scaled.safetensors`` denoiser holds float8 weights and float32 ``scale_weight`` tensors in the
original (BFL) names. ``model.single_files`` builds its Linear layers as scaled fp8 straight from the codes
(``diffpipe.models.comfy_fp8``); this measures that no 16-bit copy of the model appears on the way. The
script writes FLUX.1-dev's transformer at real width (hidden 3072) and reduced depth (1 double and 2 single
blocks, as ``checkpoint_load_memory.py``) in BFL names twice: in bf16, and in the fp8-scaled layout (every
block Linear and the final modulation quantised with a float32 scale per output row; the embedders and
the final projection bf16). Each point loads in a fresh process through ``Family.load_denoiser`` with
``model.dtype: bfloat16``, freezes the denoiser and applies ``train.base_weights: fp8``
(``enable_fp8_base_weights``) as training does, reads every tensor once, and reports the peak resident
memory (``VmHWM``) above the process's memory before the load, and what stays resident after:

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/comfy_fp8_load.py

A third point checks the loaded layers at this width: every ScaledFp8Linear built from the file (fused
``qkv`` and ``linear1`` split by diffusers' converter, the final modulation's halves swapped) holds exactly
the codes and scales that quantising the bf16 model's own rows gives.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from real_width_memory import _rss  # this folder is on sys.path when run as a script

FLUX_REDUCED = {"num_layers": 1, "num_single_layers": 2}
POINTS = {
    "bf16": ("bf16 .safetensors (BFL names), `base_weights: fp8` after the load", "flux-bf16.safetensors"),
    "fp8-scaled": ("ComfyUI fp8-scaled .safetensors (BFL names), `base_weights: fp8`", "flux-fp8-scaled.safetensors"),
}
_NORMS = [("transformer_blocks.{i}.attn.norm_q.weight", "double_blocks.{i}.img_attn.norm.query_norm.scale"),
          ("transformer_blocks.{i}.attn.norm_k.weight", "double_blocks.{i}.img_attn.norm.key_norm.scale"),
          ("transformer_blocks.{i}.attn.norm_added_q.weight", "double_blocks.{i}.txt_attn.norm.query_norm.scale"),
          ("transformer_blocks.{i}.attn.norm_added_k.weight", "double_blocks.{i}.txt_attn.norm.key_norm.scale"),
          ("single_transformer_blocks.{i}.attn.norm_q.weight", "single_blocks.{i}.norm.query_norm.scale"),
          ("single_transformer_blocks.{i}.attn.norm_k.weight", "single_blocks.{i}.norm.key_norm.scale")]


def _bfl(model) -> dict:
    """The transformer's tensors in BFL's names: our export key map's row segments for the Linear layers
    (fused ``qkv`` / ``linear1``, swapped final modulation), the QK norms by name."""
    import torch

    from diffpipe.export.keymaps import keymap_for_model

    state = model.state_dict()
    out = {}
    for layer in keymap_for_model("flux", model).layers:
        for param in ("weight", "bias"):
            parts = [state[f"{s.module}.{param}"][s.start:s.start + s.size] for s in layer.segments]
            out[f"{layer.original}.{param}"] = torch.cat(parts)
    blocks = {"transformer_blocks": model.config.num_layers, "single_transformer_blocks": model.config.num_single_layers}
    for ours, theirs in _NORMS:
        for i in range(blocks[ours.split(".")[0]]):
            out[theirs.format(i=i)] = state[ours.format(i=i)]
    assert sum(t.numel() for t in out.values()) == sum(t.numel() for t in state.values()), "every tensor placed"
    return out


def _quantised(key: str) -> bool:
    return key.endswith(".weight") and key.startswith(("double_blocks.", "single_blocks.", "final_layer.adaLN"))


def _row_codes(weight):
    """Codes and float32 per-row scales as the file's writer makes them (largest magnitude -> 448)."""
    import torch

    w = weight.float()
    top = w.abs().amax(dim=1)
    scale = torch.where(top > 0, top / 448.0, torch.ones_like(top))
    return (w / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def save(root: Path) -> None:
    """Write the config folder and both files (a separate process, so their building does not count)."""
    import diffusers
    import torch
    from safetensors.torch import save_file

    from diffpipe.families.published import PUBLISHED

    spec = PUBLISHED["flux1-dev"]
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = getattr(diffusers, spec.cls)(**{**spec.config, **FLUX_REDUCED})
    model.save_config(root / "transformer")
    bfl = _bfl(model)
    del model
    save_file(bfl, str(root / POINTS["bf16"][1]))
    fp8 = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}
    for key in list(bfl):
        if _quantised(key):
            fp8[key], fp8[key.replace(".weight", ".scale_weight")] = _row_codes(bfl.pop(key))
        else:
            fp8[key] = bfl.pop(key)
    save_file(fp8, str(root / POINTS["fp8-scaled"][1]))


def _family(name: str, root: Path):
    from diffpipe.config import ModelConfig
    from diffpipe.families import get_family

    cfg = ModelConfig(family="flux", flavor="local", path=str(root), dtype="bfloat16",
                      single_files={"transformer": str(root / POINTS[name][1])})
    return get_family(cfg)


def point(name: str, root: Path) -> dict:
    """Load one file in this process as training does with base_weights fp8; measured bytes."""
    import gc

    import torch

    from diffpipe.training.precision import ScaledFp8Linear, enable_fp8_base_weights

    family = _family(name, root)  # the family's modules imported before the baseline: they are not the load
    import diffusers.loaders.single_file_utils  # noqa: F401

    gc.collect()
    baseline = _rss("VmRSS")
    model = family.load_denoiser().requires_grad_(False)  # frozen, as under a LoRA
    enable_fp8_base_weights(model)
    tensors = [*model.parameters(), *model.buffers()]
    for t in tensors:  # every page resident (an integer view's maximum: no temporary copy)
        t.view(torch.int8 if t.element_size() == 1 else torch.int16 if t.element_size() == 2 else torch.int32).amax()
    peak = _rss("VmHWM")
    gc.collect()
    held = _rss("VmRSS")
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return {"point": name, "file_bytes": (root / POINTS[name][1]).stat().st_size, "measured_bytes": peak - baseline,
            "held_bytes": held - baseline, "weight_bytes": sum(seen.values()),
            "fp8_layers": sum(isinstance(m, ScaledFp8Linear) for m in model.modules())}


def verify(root: Path) -> dict:
    """Each file layer's codes and scales equal those of the bf16 model's own rows, quantised alike."""
    import torch

    from diffpipe.training.precision import ScaledFp8Linear

    fp8, ref = _family("fp8-scaled", root).load_denoiser(), dict(_family("bf16", root).load_denoiser().named_modules())
    checked = 0
    for name, layer in fp8.named_modules():
        if isinstance(layer, ScaledFp8Linear):
            codes, scale = _row_codes(ref[name].weight)
            assert torch.equal(layer.weight, codes.view(torch.uint8)), name
            assert torch.equal(layer.weight_scale.view(torch.float32)[:, 0], scale), name
            checked += 1
    return {"point": "verify", "layers_checked": checked}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--point", nargs=2, metavar=("POINT", "DIR"))
    ap.add_argument("--save", metavar="DIR")
    args = ap.parse_args()
    if args.save:
        return save(Path(args.save))
    if args.point:
        name, root = args.point[0], Path(args.point[1])
        print(json.dumps(verify(root) if name == "verify" else point(name, root)))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # RSS follows the live tensors
    gib = 2**30
    rows = ["| file (FLUX.1-dev, real width, 1 double + 2 single blocks) | on disk | peak RSS of the load | "
            "resident after | weights held |", "| --- | --- | --- | --- | --- |"]
    with tempfile.TemporaryDirectory(prefix="diffpipe-comfy-") as tmp:
        subprocess.run([sys.executable, __file__, "--save", tmp], check=True, env=env)
        for name in (*POINTS, "verify"):
            out = subprocess.run([sys.executable, __file__, "--point", name, tmp], capture_output=True, text=True,
                                 env=env)
            if out.returncode:
                sys.exit(f"{name} failed:\n{out.stderr[-3000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            if name == "verify":
                print(f"verified: {r['layers_checked']} fp8 layers hold the bf16 rows' own codes and scales")
                continue
            rows.append(f"| {POINTS[name][0]} | {r['file_bytes'] / gib:.2f} GiB | {r['measured_bytes'] / gib:.2f} GiB "
                        f"| {r['held_bytes'] / gib:.2f} GiB | {r['weight_bytes'] / gib:.2f} GiB |")
            print(rows[-1], json.dumps(r), flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
