"""Peak RSS while loading real-width bf16 checkpoints, against their size on disk: no float32 copy.

A 12B denoiser loaded in float32 and then cast needs twice its bf16 size at once (48 GB for FLUX.1-dev
where 24 GB suffice). This benchmark saves real-width, reduced-depth bf16 checkpoints (FLUX.1-dev's
transformer with 1 double and 2 single blocks; T5-XXL's encoder with 2 of its 24 layers, full
vocabulary) and loads each in a fresh process through the loaders ``diffpipe train`` and the cache jobs
call (``Family.load_denoiser`` for a diffusers folder and for a single ``.safetensors`` file,
``_common.pretrained_text_encoder`` for the T5 the text-cache job loads), with ``model.dtype`` and
``model.text_encoder_dtype`` at ``bfloat16``. It reports the peak resident memory (``VmHWM``) above the
process's memory before the load, after reading every loaded tensor once (safetensors maps the file, so
unread pages would not count), against the checkpoint's bytes, and checks every loaded tensor is
bfloat16:

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/checkpoint_load_memory.py
    .venv/bin/python benchmarks/checkpoint_load_memory.py --point folder DIR   # one point, JSON

Target: peak within 10 % of the checkpoint's size. The ``t5-fp8`` point loads the same T5 and stores it in
float8 as ``model.text_encoder_weights: fp8`` does (``diffpipe.models.casting.enable_fp8_text_encoder``): its weights, what
the cache job moves to the GPU, shrink, while the peak also counts the bf16 file pages it was read from
(the last column counts each tensor's storage once).
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

#: FLUX.1-dev's transformer at its real width, 1 double and 2 single blocks.
FLUX_REDUCED = {"num_layers": 1, "num_single_layers": 2}
#: T5-XXL's encoder (FLUX.1's and SD3's text_encoder_2/3) at its real width, 2 of 24 layers.
T5_XXL_REDUCED = {"vocab_size": 32128, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 2, "num_heads": 64,
                  "feed_forward_proj": "gated-gelu", "is_gated_act": True, "dense_act_fn": "gelu_new"}
POINTS = {  # point -> (what is loaded, the file(s) it reads)
    "folder": ("FLUX.1-dev transformer, diffusers folder", "transformer"),
    "single-file": ("FLUX.1-dev transformer, one .safetensors file", "flux-reduced.safetensors"),
    "t5": ("T5-XXL encoder (text-cache job)", "text_encoder_2"),
    "t5-fp8": ("T5-XXL encoder (text-cache job), `model.text_encoder_weights: fp8`", "text_encoder_2"),
}


def save(root: Path) -> None:
    """Write the bf16 checkpoints (a separate process, so their building does not count)."""
    import diffusers
    import torch
    from safetensors.torch import save_file
    from transformers import T5Config, T5EncoderModel

    from diffpipe.families.published import PUBLISHED

    spec = PUBLISHED["flux1-dev"]
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = getattr(diffusers, spec.cls)(**{**spec.config, **FLUX_REDUCED})
    model.save_pretrained(root / "transformer")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(root / "flux-reduced.safetensors"))
    del model
    T5EncoderModel(T5Config(**T5_XXL_REDUCED)).save_pretrained(root / "text_encoder_2")


def point(name: str, root: Path) -> dict:
    """Load one checkpoint in this process; measured bytes, file bytes and the loaded dtypes."""
    import gc

    import torch
    from transformers import T5EncoderModel

    from diffpipe.config import ModelConfig
    from diffpipe.families import get_family
    from diffpipe.models import _common as common

    files = root / POINTS[name][1]
    size = sum(f.stat().st_size for f in ([files] if files.is_file() else files.rglob("*.safetensors")))
    single = {"single_files": {"transformer": str(files)}} if name == "single-file" else {}
    cfg = ModelConfig(family="flux", flavor="local", path=str(root), dtype="bfloat16", text_encoder_dtype="bfloat16", **single)
    gc.collect()
    baseline = _rss("VmRSS")
    if name.startswith("t5"):
        model = common.pretrained_text_encoder(T5EncoderModel, cfg, "text_encoder_2")
        if name == "t5-fp8":  # what Family.stored_text applies to every text encoder it returns
            from diffpipe.models.casting import enable_fp8_text_encoder

            enable_fp8_text_encoder(model, torch.bfloat16)
    else:
        model = get_family(cfg).load_denoiser()
    # safetensors maps the file: read every tensor once, as the first training step does, so each page is
    # resident (the maximum of an integer view: no temporary copy of the tensor).
    for tensor in model.state_dict().values():
        tensor.view(torch.int8 if tensor.element_size() == 1 else torch.int16).amax()
    peak = _rss("VmHWM")
    gc.collect()
    held = _rss("VmRSS")  # what the job holds while it encodes
    dtypes = sorted({str(t.dtype) for t in model.state_dict().values()})
    params = sum(t.numel() for t in model.parameters())
    expected = [str(torch.bfloat16), str(torch.float8_e4m3fn)] if name == "t5-fp8" else [str(torch.bfloat16)]
    assert dtypes == sorted(expected), f"{name}: loaded dtypes {dtypes}"
    return {"point": name, "file_bytes": size, "measured_bytes": peak - baseline, "held_bytes": held - baseline,
            "weight_bytes": _unique_bytes(model), "params": params, "dtypes": dtypes}


def _unique_bytes(model) -> int:
    """The bytes of the module's tensors, each storage once (T5's token embedding is tied): what the job
    moves to the GPU."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.state_dict().values()}
    return sum(seen.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--point", nargs=2, metavar=("POINT", "DIR"))
    ap.add_argument("--save", metavar="DIR")
    ap.add_argument("--points", default=",".join(POINTS))
    args = ap.parse_args()
    if args.save:
        save(Path(args.save))
        return
    if args.point:
        print(json.dumps(point(args.point[0], Path(args.point[1]))))
        return
    # A fixed mmap threshold, as in real_width_memory.py: RSS then follows the live tensors.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    rows = ["| checkpoint (bf16, real width, reduced depth) | parameters | on disk | peak RSS of the load | peak / disk "
            "| weights held (to the GPU) |", "| --- | --- | --- | --- | --- | --- |"]
    with tempfile.TemporaryDirectory(prefix="diffpipe-load-") as tmp:
        subprocess.run([sys.executable, __file__, "--save", tmp], check=True, env=env)
        for name in args.points.split(","):
            out = subprocess.run([sys.executable, __file__, "--point", name, tmp], capture_output=True, text=True,
                                 env=env)
            if out.returncode:
                print(out.stderr[-3000:], file=sys.stderr)
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            gib = 2**30
            rows.append(f"| {POINTS[name][0]} | {r['params'] / 1e9:.2f} B | {r['file_bytes'] / gib:.2f} GiB | "
                        f"{r['measured_bytes'] / gib:.2f} GiB | {r['measured_bytes'] / r['file_bytes']:.2f} | "
                        f"{r['weight_bytes'] / gib:.2f} GiB |")
            print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
