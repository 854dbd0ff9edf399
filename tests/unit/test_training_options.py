"""The train log's "options in effect" line (``diffpipe.training.options``): every option that changes what is
trained or how, as it took effect."""

from __future__ import annotations

from diffpipe.config import Config
from diffpipe.training.options import training_options

DATA = [{"name": "d", "path": "/data"}]
PLAN = {"gpu_bytes": 24 * 2**30, "system_bytes": 64 * 2**30, "explicit": ["base_weights"],
        "chosen": {"base_weights": "fp8", "estimate_bytes": 20 * 2**30}, "runner_up": None}


def test_options_in_effect_name_what_is_trained_and_how():
    cfg = Config(
        output_dir="/tmp/x", datasets=DATA,
        model={"family": "flux", "base_loras": [{"path": "adapters/turbo.safetensors", "scale": 0.8},
                                                {"path": "org/name/speed.safetensors"}]},
        train={"mode": "full", "optimizer": "adamw8bit", "optimizer_in_backward": True, "grad_clip": 0,
               "precision": "bf16", "optimizer_args": {"betas": [0.9, 0.99]}, "memory": "auto", "gpu_memory": 24,
               "token_routing": {"keep": 0.5, "start_block": 1, "end_block": 7}},
    )
    got = training_options(cfg, PLAN)
    assert got == {
        "mode": "full",
        "text_encoders": "frozen",
        "optimizer": "adamw8bit {'betas': [0.9, 0.99]}",
        "optimizer_in_backward": True,
        "grad_clip": 0.0,
        "base_loras": "adapters/turbo.safetensors at scale 0.8; org/name/speed.safetensors at scale 1",
        "token_routing": "keep 0.5 over blocks 1..6",
        "ema": "off",
        "memory": "auto, planned for a 24.0 GiB GPU (estimate 20.00 GiB; kept as written: base_weights)",
    }


def test_a_plain_lora_run_says_so():
    cfg = Config(output_dir="/tmp/x", datasets=DATA, train={
        "lora": {"rank": 4, "alpha": 2}, "ema": {"enabled": True, "decay": 0.99},
        "text_encoder": {"encoders": ["text_encoder"]}})
    got = training_options(cfg)
    assert got["mode"] == "lora rank 4 alpha 2" and got["text_encoders"] == "text_encoder"
    assert got["base_loras"] == "none" and got["token_routing"] == "off" and got["ema"] == "decay 0.99"
    assert got["optimizer"] == "adamw" and got["memory"] == "manual"
