"""Training precision, component dtypes and fp8 base weights (issue #15)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from diffpipe.config import ModelConfig, TrainConfig
from diffpipe.families import get_family
from diffpipe.models import _common as common
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
    for role in ("denoiser", "text_encoder", "vae"):
        assert common.load_dtype(flux, role, cuda=False) == torch.float32
        assert common.load_dtype(flux, role, cuda=True) == torch.bfloat16
    assert get_family(flux).vae_dtype(cuda=True) == torch.bfloat16
    assert get_family(sd).vae_dtype(cuda=True) == torch.float32  # SD's VAE stays in float32
    assert get_family(sd).vae_dtype(cuda=False) == torch.float32
    assert common.load_dtype(sd, "denoiser", cuda=True) == torch.bfloat16
    assert get_family(ModelConfig(family="sd", vae_dtype="bfloat16")).vae_dtype(cuda=True) == torch.bfloat16


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


@pytest.mark.parametrize("name", ["flux", "ltx2", "qwenimage-edit"])
def test_fp8_text_encoders_store_float8_and_encode_close(name):
    """``model.text_encoder_weights: fp8``: every text-side Linear is stored in float8 except what keeps its
    compute dtype (norms, embeddings, T5's float32 ``wo``), checked tensor by tensor; the embeddings are
    within 20% (relative L2; the tiny random encoders measure 3-4% for sequence states, up to 13% for
    CLIP's pooled output) of the float32 encoders' and not equal; the text cache key changes."""
    import re

    from diffpipe.models.casting import FP8_TEXT_SKIPPED_PATTERNS

    plain, fp8 = get_family(ModelConfig(family=name)), get_family(ModelConfig(family=name, text_encoder_weights="fp8"))
    encoders = fp8.load_text_encoders()
    parts = encoders.parts if hasattr(encoders, "parts") else vars(encoders)
    modules = {n: m for n, m in parts.items() if isinstance(m, torch.nn.Module)}
    assert modules
    for part, module in modules.items():
        kept = getattr(module, "_keep_in_fp32_modules", None) or []
        for layer, m in module.named_modules():
            if not isinstance(m, torch.nn.Linear | torch.nn.Embedding):
                continue
            keeps = isinstance(m, torch.nn.Embedding) or any(re.search(p, layer) for p in FP8_TEXT_SKIPPED_PATTERNS) \
                or layer.rsplit(".", 1)[-1] in kept
            assert m.weight.dtype == (torch.float32 if keeps else torch.float8_e4m3fn), f"{part}.{layer}"
    assert fp8.text_identity() != plain.text_identity()
    if name == "qwenimage-edit":  # its captions are encoded with their images (tests/stages/test_qwenimage_edit.py)
        return
    captions = ["a red circle", "two blue cups on a table"]
    with torch.no_grad():
        ours, reference = fp8.encode_text(encoders, captions), plain.encode_text(plain.load_text_encoders(), captions)
    for key, value in reference.items():
        if key.endswith("mask"):
            assert torch.equal(ours[key], value), key
        else:
            rel = ((ours[key] - value).norm() / value.norm()).item()
            assert 0 < rel < 0.2, f"{key}: relative error {rel:.3f}"


def test_fp8_text_encoders_refuse_text_encoder_training():
    from diffpipe.config import Config

    cfg = {"model": {"family": "sdxl", "text_encoder_weights": "fp8"},
           "datasets": [{"name": "d", "path": "data"}], "train": {"text_encoder": {"encoders": ["text_encoder"]}}}
    with pytest.raises(ValueError, match="text_encoder_weights fp8 stores the text encoders in float8"):
        Config.model_validate(cfg)
