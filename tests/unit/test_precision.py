"""Training precision, component dtypes and fp8 base weights (issue #15)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from diffpipe.config import ModelConfig, TrainConfig
from diffpipe.models import _common as common
from diffpipe.models import get_family
from diffpipe.training.engine import deepspeed_config
from diffpipe.training.precision import check, resolve_precision


def test_auto_precision_is_bf16_on_cuda_and_fp32_on_cpu():
    tc = TrainConfig()
    assert tc.precision == "auto"
    assert resolve_precision("auto", cuda=True) == "bf16" and resolve_precision("auto", cuda=False) == "fp32"
    assert resolve_precision("fp16", cuda=False) == "fp16"
    ds = deepspeed_config(tc, 1)
    assert ds["bf16"]["enabled"] == torch.cuda.is_available() and not ds["fp16"]["enabled"]


def test_auto_dtypes_by_device_and_family():
    sd, flux = ModelConfig(family="sd"), ModelConfig(family="flux")
    get_family(sd), get_family(flux)  # registers both
    for role in ("denoiser", "text_encoder", "vae"):
        assert common.load_dtype(flux, role, cuda=False) == torch.float32
        assert common.load_dtype(flux, role, cuda=True) == torch.bfloat16
    assert common.load_dtype(sd, "vae", cuda=True) == torch.float32  # SD's VAE stays in float32
    assert common.load_dtype(sd, "denoiser", cuda=True) == torch.bfloat16
    assert common.load_dtype(ModelConfig(family="sd", vae_dtype="bfloat16"), "vae", cuda=True) == torch.bfloat16


class _Float32Outputs(TorchDispatchMode):
    """Records every float32 CPU tensor of two or more dimensions an op produces (a weight-sized copy)."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype == torch.float32 and t.ndim >= 2:
                self.seen.append((str(func), tuple(t.shape)))
        return out


def test_bf16_folder_loads_straight_into_bf16(tmp_path):
    tiny = get_family(ModelConfig(family="sd"))
    pipe = tiny.load_pipeline()
    for name in ("unet", "vae", "text_encoder"):
        getattr(pipe, name).to(torch.bfloat16)
    pipe.save_pretrained(tmp_path)
    cfg = ModelConfig(family="sd", flavor="local", path=str(tmp_path), dtype="bfloat16",
                      text_encoder_dtype="bfloat16", vae_dtype="bfloat16")
    local = get_family(cfg)
    with _Float32Outputs() as watch:
        parts = {"unet": local.load_denoiser(), "vae": local.load_vae(),
                 "text_encoder": local.load_text_encoders().text_encoder}
    for name, module in parts.items():
        for key, p in module.named_parameters():
            assert p.dtype == torch.bfloat16, f"{name}.{key}: {p.dtype}"
    assert watch.seen == [], f"float32 copies made while loading: {watch.seen[:3]}"
    # The cache keys name the encoders' dtype: bf16 encoders re-encode, float32 keys are unchanged.
    fp32 = get_family(cfg.model_copy(update={"text_encoder_dtype": "float32", "vae_dtype": "float32"}))
    assert local.text_identity() != fp32.text_identity() == fp32.encoders_identity()
    assert local.vae_identity() != fp32.vae_identity() == fp32.vae_weights_identity()


def test_fp16_and_gpu_attention_backends_are_refused_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU errors")
    with pytest.raises(ValueError, match="train.precision fp16 needs a CUDA GPU"):
        check(TrainConfig(precision="fp16"))
    with pytest.raises(ValueError, match="train.attention_backend 'flash' needs a CUDA GPU"):
        check(TrainConfig(attention_backend="flash"))
    with pytest.raises(ValueError, match="'flsh': not a diffusers attention backend; known: .*flash"):
        check(TrainConfig(attention_backend="flsh"))
    check(TrainConfig(attention_backend="native"))


def test_estimate_sizes_auto_precision_as_bf16():
    from diffpipe.config import Config
    from diffpipe.estimate import estimate_memory

    def est(precision):
        cfg = Config.model_validate({"model": {"family": "sd"}, "datasets": [{"name": "d", "path": "d", "resolution": 64}],
                                     "train": {"batch_size": 1, "precision": precision}})
        return estimate_memory(cfg, model="sd15", rank=4)

    auto, bf16 = est("auto"), est("bf16")
    assert auto.precision == "bf16" and auto.total_bytes == bf16.total_bytes
