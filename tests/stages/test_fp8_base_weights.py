"""``train.base_weights: fp8``, ``int8`` and ``nf4`` on CPU: 8- and 4-bit storage of the frozen denoiser,
LoRA untouched, losses close to bf16, exact resume."""

from __future__ import annotations

import re

import peft
import pytest
import torch
from stage_cli import in_process

from diffpipe.config import ModelConfig, TrainConfig
from diffpipe.families import get_family
from diffpipe.paths import RunPaths
from diffpipe.training import adapter, precision
from diffpipe.training.metrics import read_metrics

# diffusers' DEFAULT_SKIP_MODULES_PATTERN (0.42.1): layers layerwise casting leaves alone.
SKIPPED = ("pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$")
TRAIN = {"precision": "bf16", "max_steps": 3, "checkpoint_every_steps": 1, "keep_checkpoints": 0}


def test_fp8_stores_frozen_weights_in_float8_and_keeps_the_lora():
    family = get_family(ModelConfig(family="sd"))
    unet = family.load_denoiser()
    lora = adapter.add_lora(unet, peft.LoraConfig(r=4, lora_alpha=4, target_modules=family.lora_targets(None)))
    precision.prepare_denoiser(unet, TrainConfig(precision="bf16", base_weights="fp8"))
    cast = convs = 0
    for name, module in unet.named_modules():
        if "lora_" in name or not isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
            continue
        if isinstance(module, torch.nn.Conv2d) or any(re.search(p, name) for p in SKIPPED):
            assert not isinstance(module, precision.ScaledFp8Linear) and module.weight.dtype == torch.float32, name
            convs += isinstance(module, torch.nn.Conv2d)
        else:  # e4m3 codes and a bf16 scale per output channel, as integer views no module-wide cast touches
            assert isinstance(module, precision.ScaledFp8Linear), name
            assert module.weight.dtype == torch.uint8 and module.weight_scale.dtype == torch.uint16, name
            assert module.weight_scale.shape == (module.out_features, 1) and not module.weight.requires_grad
            cast += 1
    assert cast > 10 and convs > 10
    assert all(p.requires_grad and p.dtype == torch.float32 for p in lora)
    assert {n for n, p in unet.named_parameters() if p.requires_grad} == {n for n, _ in unet.named_parameters()
                                                                          if "lora_" in n}


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_quantisation_stores_the_layers_fp8_casts_and_keeps_the_lora(kind):
    family = get_family(ModelConfig(family="sd"))
    fp8, quant = family.load_denoiser(), family.load_denoiser()
    config = peft.LoraConfig(r=4, lora_alpha=4, target_modules=family.lora_targets(None))
    adapter.add_lora(fp8, config)
    lora = adapter.add_lora(quant, config)
    before = {n: p.numel() for n, p in quant.named_parameters()}
    precision.prepare_denoiser(fp8, TrainConfig(precision="bf16", base_weights="fp8"))
    precision.prepare_denoiser(quant, TrainConfig(precision="bf16", base_weights=kind))
    cast = {n for n, m in fp8.named_modules() if isinstance(m, precision.ScaledFp8Linear)}
    subclass = {"int8": "Int8Tensor", "nf4": "NF4Tensor"}[kind]
    quantised = {n.removesuffix(".weight") for n, b in quant.named_buffers() if type(b).__name__ == subclass}
    assert len(cast) > 10 and quantised == cast
    assert not any(type(p).__name__ == subclass for p in quant.parameters())
    assert not any(k.removesuffix(".weight") in quantised for k in quant.state_dict())  # out of checkpoints
    for name in quantised:
        weight = quant.get_submodule(name).weight
        if kind == "int8":
            assert weight.qdata.dtype == torch.int8
        else:  # two 4-bit codes per byte, an int8 scale per 64 weights, as the estimate counts them
            numel = before[name + ".weight"]
            assert weight.quantized_data.dtype == torch.uint8 and weight.quantized_data.numel() == numel // 2
            assert weight.quantized_scalers.dtype == torch.int8 and weight.quantized_scalers.numel() == numel // 64
            inner = sum(getattr(weight, a).nbytes for a in weight.__tensor_flatten__()[0])
            assert inner == precision.nf4_bytes(numel, 2)
    assert all(p.requires_grad and p.dtype == torch.float32 for p in lora)
    latents, text = torch.randn(2, 4, 1, 16, 16), {"prompt_embeds": torch.randn(2, 77, 32, dtype=torch.bfloat16)}
    quant.bfloat16()  # as DeepSpeed's bf16 mode casts the parameters (the quantised buffers stay)
    assert {n.removesuffix(".weight") for n, b in quant.named_buffers() if type(b).__name__ == subclass} == quantised
    family.loss(quant.train(), latents, text, torch.Generator().manual_seed(0)).mean().backward()
    assert sum(bool(p.grad.abs().sum() > 0) for p in lora) >= len(lora) // 2


def test_nf4_scaler_groups_are_qloras_at_real_size():
    assert precision.nf4_scaler_block(3072 * 3072) == 256  # FLUX.1-dev's attention projections
    assert precision.nf4_scaler_block(5120 * 13824) == 256  # Wan 14B's feed-forward
    assert precision.nf4_scaler_block(32 * 32) == 16  # a tiny layer: 16 blocks of 64
    assert precision.nf4_scaler_block(32 * 33) is None


def test_quantisation_without_torchao_is_a_clear_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    with pytest.raises(ValueError, match="train.base_weights nf4 needs torchao"):
        precision.enable_quantised_base_weights(torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.float32, "nf4")


@pytest.mark.parametrize("checkpointing", [False, True])
def test_fp8_unet_steps_with_and_without_checkpointing(checkpointing):
    """A convolution saves its weight tensor itself for backward; were it float8-stored, the casting hook
    would hand the backward (or the recomputation) float8. Convolutions stay bf16, so a UNet steps."""
    family = get_family(ModelConfig(family="sd"))
    unet = family.load_denoiser()
    lora = adapter.add_lora(unet, peft.LoraConfig(r=2, lora_alpha=2, target_modules=family.lora_targets(None)))
    unet.to(torch.bfloat16)  # as DeepSpeed's bf16 mode casts the module
    if checkpointing:
        unet.enable_gradient_checkpointing()
    tc = TrainConfig(precision="bf16", base_weights="fp8", activation_checkpointing=checkpointing)
    precision.prepare_denoiser(unet.train(), tc)
    assert not any(m.weight.dtype == torch.uint8 for m in unet.modules() if isinstance(m, torch.nn.Conv2d))
    latents, text = torch.randn(2, 4, 1, 16, 16), {"prompt_embeds": torch.randn(2, 77, 32, dtype=torch.bfloat16)}
    family.loss(unet, latents, text, torch.Generator().manual_seed(0)).mean().backward()
    assert all(p.grad is not None for p in lora) and sum(bool(p.grad.abs().sum() > 0) for p in lora) >= len(lora) // 2


@pytest.mark.parametrize("variant", ["t2v", "i2v"])
def test_fp8_ltx2_steps_with_checkpointing(variant):
    """LTX-2's video stream under fp8 base weights and checkpointing, with the audio placeholder and (i2v)
    the per-token timestep: the blocks' Linear weights are float8, and every LoRA B gets a gradient."""
    family = get_family(ModelConfig(family="ltx2", variant=variant))
    den = family.load_denoiser()
    adapter.add_lora(den, peft.LoraConfig(r=2, lora_alpha=2, target_modules=family.lora_targets(None)))
    den.to(torch.bfloat16)  # as DeepSpeed's bf16 mode casts the module
    den.enable_gradient_checkpointing()
    precision.prepare_denoiser(den.train(), TrainConfig(precision="bf16", base_weights="fp8",
                                                        activation_checkpointing=True))
    assert isinstance(den.transformer_blocks[0].attn1.to_q.base_layer, precision.ScaledFp8Linear)
    latents = torch.randn(2, 8, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    text = family.encode_text(family.load_text_encoders(), ["a red circle", "a blue square"])
    aux = {"control": latents[:, :, :1]} if variant == "i2v" else {}
    family.loss(den, latents, text, torch.Generator().manual_seed(0), **aux).mean().backward()
    b = [p for n, p in den.named_parameters() if "lora_B" in n]
    assert b and all(p.grad is not None and p.grad.abs().sum() > 0 for p in b)


def _train(tiny_run, cli, root, base_weights) -> list[float]:
    cfg = tiny_run.clone(root / base_weights, **TRAIN, base_weights=base_weights)
    # int8 and nf4 in a process of their own: the torchao import below is its first (its warnings would not
    # show again in this one). Scaled fp8 is ours and imports no torchao: it trains here (`in_process`).
    result = in_process("train", "-c", str(cfg)) if base_weights == "fp8" else cli("train", "-c", str(cfg))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "torchao" not in result.stderr  # its import-time warnings are kept quiet
    return [r["loss"] for r in read_metrics(RunPaths(root / base_weights / "run").metrics)]


@pytest.fixture(scope="module")
def bf16_losses(tiny_run, tmp_path_factory):
    """The plain bf16 run the 8-bit runs are compared with (in this process: it imports no torchao)."""
    root = tmp_path_factory.mktemp("bf16")
    result = in_process("train", "-c", str(tiny_run.clone(root / "auto", **TRAIN, base_weights="auto")))
    assert result.returncode == 0, result.stderr[-3000:]
    return [r["loss"] for r in read_metrics(RunPaths(root / "auto" / "run").metrics)]


@pytest.mark.parametrize("kind", ["fp8", "int8", "nf4"])
def test_quantised_base_weights_train_close_to_bf16_and_resume_exactly(kind, bf16_losses, tiny_run, cli, tmp_path):
    losses = {"auto": bf16_losses, kind: _train(tiny_run, cli, tmp_path, kind)}
    assert len(losses[kind]) == 3
    # float8_e4m3fn keeps 3 mantissa bits (per-weight error up to 6%), int8 with a scale per output channel
    # about 0.4%, NF4 16 levels scaled per 64 weights. Scaled fp8 is held to 0.2% of bf16's losses.
    for a, b in zip(losses["auto"], losses[kind], strict=True):
        assert abs(a - b) <= (0.002 if kind == "fp8" else 0.01) * abs(a), (losses["auto"], losses[kind])
    assert losses["auto"] != losses[kind]  # the run really ran on 8-bit weights
    resumed = in_process("train", "-c", str(tmp_path / kind / "config.yaml"), "--checkpoint", "step-000001")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = [r["loss"] for r in read_metrics(RunPaths(tmp_path / kind / "run").metrics)]
    assert again == losses[kind]
    print("losses bf16", losses["auto"], kind, losses[kind])


@pytest.mark.parametrize("kind", ["fp8", "int8", "nf4"])
def test_quantisation_refuses_what_moves_frozen_weights(kind):
    refused = [{"zero_stage": 3}, {"mode": "full"}, {"pipeline_stages": 2}]
    for extra in refused + ([{"block_swap": 2}] if kind != "fp8" else []):
        with pytest.raises(ValueError, match=f"train.base_weights: {kind}"):
            TrainConfig(base_weights=kind, **extra)
    if kind == "fp8":  # block swap moves fp8's buffers with their block (tests/stages/test_offload_compile.py)
        assert TrainConfig(base_weights=kind, block_swap=2, activation_checkpointing=True).block_swap == 2
