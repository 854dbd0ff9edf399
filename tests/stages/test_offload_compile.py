"""``train.block_swap`` (frozen block weights in CPU memory, brought back per forward and recomputation),
``train.activation_offload`` (saved activations in CPU memory) and ``train.compile`` (regional
compilation) on CPU."""

from __future__ import annotations

import copy
import json
import re

import peft
import pytest
import torch
from stage_cli import in_process

from diffpipe.config import ModelConfig, TrainConfig
from diffpipe.families import get_family
from diffpipe.paths import RunPaths
from diffpipe.training import checkpointing, offload, precision
from diffpipe.training.metrics import read_metrics


def _lora_denoiser(family_name: str) -> tuple[torch.nn.Module, object]:
    family = get_family(ModelConfig(family=family_name))
    torch.manual_seed(0)
    den = family.load_denoiser().requires_grad_(False)
    # Non-zero B: the LoRA changes the output, so its gradients reach every layer.
    den.add_adapter(peft.LoraConfig(r=4, lora_alpha=4, target_modules=family.lora_targets(None),
                                    init_lora_weights=False))
    den.enable_gradient_checkpointing()
    return den.train(), family


def _step(den, family, latents, text):
    loss = family.loss(den, latents, text, torch.Generator().manual_seed(1)).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in den.named_parameters() if p.requires_grad}


INPUTS = {
    "flux": lambda: (torch.randn(2, 1, 1, 16, 16), {"prompt_embeds": torch.randn(2, 8, 32),
                                                     "pooled_prompt_embeds": torch.randn(2, 32)}),
    "sd": lambda: (torch.randn(2, 4, 1, 16, 16), {"prompt_embeds": torch.randn(2, 77, 32)}),
}


def test_block_swap_gives_the_same_step_and_never_moves_the_lora():
    den, family = _lora_denoiser("flux")
    ref = copy.deepcopy(den)
    torch.manual_seed(2)
    latents, text = INPUTS["flux"]()
    lora = {n: p.data_ptr() for n, p in den.named_parameters() if p.requires_grad}
    blocks = offload.swap_blocks(den)
    swap = offload.install(den, 1000, torch.device("cpu"))
    frozen = sum(t.nbytes for b in blocks for t in offload.frozen_tensors(b))
    assert swap.cpu_bytes == frozen > 0
    loss = family.loss(den, latents, text, torch.Generator().manual_seed(1)).mean()
    assert swap.onloads == len(blocks)
    assert all(t.data_ptr() == h.data_ptr() for pairs in swap._home.values() for t, h in pairs)  # back home
    loss.backward()
    # Each block came back once more for its recomputation in the backward pass (the hooks fire
    # there too), and went home when the backward pass ended.
    assert swap.onloads == 2 * len(blocks) and not swap._pending
    assert all(t.data_ptr() == h.data_ptr() for pairs in swap._home.values() for t, h in pairs)
    grads = {n: p.grad.clone() for n, p in den.named_parameters() if p.requires_grad}
    want_loss, want = _step(ref, family, latents, text)
    assert torch.equal(loss.detach(), want_loss)
    assert grads.keys() == want.keys() and all(torch.equal(grads[k], want[k]) for k in want)
    assert {n: p.data_ptr() for n, p in den.named_parameters() if p.requires_grad} == lora
    swap.remove()
    assert all(p.device.type == "cpu" for p in den.parameters())


class _RecordingCopier(offload.SyncCopier):
    """The CPU copier, noting which block's copy starts when (the first home tensor's address)."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.started: list[int] = []

    def start(self, homes):
        self.started.append(homes[0].data_ptr())
        return super().start(homes)


def _deeper_flux():
    """The tiny Flux with 2 double and 3 single blocks, a LoRA with non-zero B, checkpointing on."""
    import diffusers

    from diffpipe.families.flux.flavors import TINY_TRANSFORMER

    family = get_family(ModelConfig(family="flux"))
    torch.manual_seed(0)
    den = diffusers.FluxTransformer2DModel(**{**TINY_TRANSFORMER, "num_layers": 2, "num_single_layers": 3})
    den.requires_grad_(False).add_adapter(peft.LoraConfig(r=4, lora_alpha=4, target_modules=family.lora_targets(None),
                                                          init_lora_weights=False))
    den.enable_gradient_checkpointing()
    return den.train(), family


def test_block_swap_prefetches_the_next_block_in_forward_and_in_the_backward_recomputation():
    den, family = _deeper_flux()
    ref = copy.deepcopy(den)
    torch.manual_seed(2)
    latents, text = INPUTS["flux"]()
    copier = _RecordingCopier(torch.device("cpu"))
    swap = offload.install(den, 4, torch.device("cpu"), copier=copier)  # blocks 1-4 of 5: block 0 runs first
    which = {pairs[0][1].data_ptr(): i for i, pairs in enumerate(swap._home.values())}
    loss = family.loss(den, latents, text, torch.Generator().manual_seed(1)).mean()
    # Forward: block 0 starts the first swapped block's copy, each swapped block the next one's, and the
    # last one its own again for the backward pass, which recomputes it first.
    assert [which[p] for p in copier.started] == [0, 1, 2, 3, 3]
    loss.backward()
    # Backward: recomputations run last to first; each starts the copy of the one before it.
    assert [which[p] for p in copier.started] == [0, 1, 2, 3, 3, 2, 1, 0]
    # Every load found its copy under way; nothing is held once the backward pass is over.
    assert swap.onloads == swap.prefetched == 8 and not swap._ahead and not swap._pending
    assert all(t.data_ptr() == h.data_ptr() for pairs in swap._home.values() for t, h in pairs)
    grads = {n: p.grad.clone() for n, p in den.named_parameters() if p.requires_grad}
    want_loss, want = _step(ref, family, latents, text)
    assert torch.equal(loss.detach(), want_loss)
    assert grads.keys() == want.keys() and all(torch.equal(grads[k], want[k]) for k in want)
    # Without gradients (sampling) the forward prefetches in order and keeps nothing for a backward pass.
    copier.started.clear()
    with torch.no_grad():
        out = family.loss(den, latents, text, torch.Generator().manual_seed(1)).mean()
    assert [which[p] for p in copier.started] == [0, 1, 2, 3] and not swap._ahead
    assert torch.equal(out, want_loss)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_block_swap_on_a_side_stream_gives_the_same_step_on_cuda():
    den, family = _deeper_flux()
    den.cuda()
    ref = copy.deepcopy(den)
    torch.manual_seed(2)
    latents, text = INPUTS["flux"]()
    latents, text = latents.cuda(), {k: v.cuda() for k, v in text.items()}
    swap = offload.install(den, 4, torch.device("cuda"))
    assert isinstance(swap.copier, offload.StreamCopier)
    loss = family.loss(den, latents, text, torch.Generator("cuda").manual_seed(1)).mean()
    loss.backward()
    assert swap.prefetched == swap.onloads == 8
    grads = {n: p.grad.clone() for n, p in den.named_parameters() if p.requires_grad}
    want_loss = family.loss(ref, latents, text, torch.Generator("cuda").manual_seed(1)).mean()
    want_loss.backward()
    want = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    # Some CUDA attention backward kernels sum in a run-dependent order: equal up to that.
    assert torch.allclose(loss.detach(), want_loss.detach(), rtol=1e-6)
    assert all(torch.allclose(grads[k], want[k], rtol=1e-5, atol=1e-8) for k in want)


def test_block_swap_settings_are_checked():
    with pytest.raises(ValueError, match="activation_checkpointing"):
        TrainConfig(block_swap=4)
    with pytest.raises(ValueError, match="zero_stage"):
        TrainConfig(block_swap=4, activation_checkpointing=True, zero_stage=3)
    with pytest.raises(ValueError, match="mode lora"):
        TrainConfig(block_swap=4, activation_checkpointing=True, mode="full")
    assert offload.install(torch.nn.Linear(2, 2), 0, torch.device("cpu")) is None
    with pytest.raises(ValueError, match="no repeated transformer blocks"):
        offload.install(torch.nn.Linear(2, 2), 1, torch.device("cpu"))
    unet, _ = _lora_denoiser("sd")  # checkpoints inside its blocks: refused, not silently wrong on a GPU
    with pytest.raises(ValueError, match="UNet2DConditionModel"):
        offload.install(unet, 1, torch.device("cpu"))


@pytest.fixture(scope="module")
def flux_tiny_run(tmp_path_factory):
    """The tiny run of ``tiny_run`` for the tiny Flux model (block swap needs transformer blocks)."""
    from tiny_runs import make_tiny_run

    return make_tiny_run(tmp_path_factory.mktemp("flux-tiny"), "flux", images=4)


def _saved_bytes_seen(den, family, latents, text) -> int:
    """Bytes the forward hands to saved-tensor hooks (what ``save_on_cpu`` would move)."""
    seen = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.nbytes)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        family.loss(den, latents, text, torch.Generator().manual_seed(1)).mean()
    return sum(seen)


def test_activation_offload_moves_block_inputs_and_gives_the_same_step():
    den, family = _lora_denoiser("flux")  # diffusers' own checkpointing
    ref = copy.deepcopy(den)
    torch.manual_seed(2)
    latents, text = INPUTS["flux"]()
    # torch's checkpoint keeps each block's inputs as saved tensors, so save_on_cpu's hooks move them too:
    # at least every block's image hidden states (2 x 64 tokens x 32 float32).
    blocks = len(offload.swap_blocks(den))
    assert _saved_bytes_seen(den, family, latents, text) >= blocks * 2 * 64 * 32 * 4
    with checkpointing.offloaded_saves(True):
        loss = family.loss(den, latents, text, torch.Generator().manual_seed(1)).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in den.named_parameters() if p.requires_grad}
    want_loss, want = _step(ref, family, latents, text)
    assert torch.equal(loss.detach(), want_loss)
    assert grads.keys() == want.keys() and all(torch.equal(grads[k], want[k]) for k in want)


def test_block_swap_and_activation_offload_train_through_diffpipe_train_and_resume_exactly(flux_tiny_run, tmp_path):
    # Losses equal to a run without swapping are proven bit for bit in-process above; here the real
    # command, with fp8 storage and DeepSpeed bf16, trains with the block-swap hooks installed (both runs),
    # with activation offload giving the losses of plain checkpointing, and resumes exactly with both.
    # The command runs in this process (`in_process`: the real Typer app), not in 3 fresh interpreters.
    train = {"precision": "bf16", "max_steps": 2, "checkpoint_every_steps": 1, "keep_checkpoints": 0,
             "activation_checkpointing": True, "base_weights": "fp8", "block_swap": 2}
    runs = {}
    for offloaded in (False, True):
        cfg = flux_tiny_run.clone(tmp_path / str(offloaded), **train, activation_offload=offloaded)
        result = in_process("train", "-c", str(cfg))
        assert result.returncode == 0, result.stderr[-3000:]
        runs[offloaded] = [r["loss"] for r in read_metrics(RunPaths(tmp_path / str(offloaded) / "run").metrics)]
        # The log and summary.json say which memory options took effect, block_swap as it resolved.
        assert re.search(r"memory options in effect: precision bf16, base_weights fp8, activation_checkpointing "
                         r"True, checkpoint_fraction 1.0, block_swap 2 of \d+ blocks, activation_offload "
                         f"{offloaded}", result.stdout + result.stderr)
        memory = json.loads((RunPaths(tmp_path / str(offloaded) / "run").train_dir / "summary.json").read_text())
        assert memory["memory"]["block_swap"].startswith("2 of ") and not any(memory["memory"]["zero_offload"].values())
        # And what is trained and how (diffpipe.training.options), in the log and summary.json alike.
        assert re.search(r"train: options in effect: mode lora rank \d+ alpha [\d.]+, text_encoders frozen, optimizer "
                         r"adamw, optimizer_in_backward False, .*base_loras none, token_routing off, ema off, memory "
                         r"manual", result.stdout + result.stderr)
        assert memory["options"]["optimizer"] == "adamw" and memory["options"]["memory"] == "manual"
    assert len(runs[True]) == 2 and runs[True] == pytest.approx(runs[False], rel=1e-6)
    resumed = in_process("train", "-c", str(cfg), "--checkpoint", "step-000001")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["loss"] for r in read_metrics(RunPaths(tmp_path / "True" / "run").metrics)] == runs[True]
    with pytest.raises(ValueError, match="activation_offload needs train.pipeline_stages: 1"):
        TrainConfig(activation_offload=True, pipeline_stages=2)


def test_regional_compile_trains_close_to_eager():
    # aot_eager traces each block with dynamo and AOT autograd, as inductor does, without a C++ compiler.
    den, family = _lora_denoiser("flux")
    ref = copy.deepcopy(den)
    torch.manual_seed(2)
    latents, text = INPUTS["flux"]()
    precision.compile_blocks(den, backend="aot_eager")
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in offload.swap_blocks(den))
    loss, grads = _step(den, family, latents, text)
    want_loss, want = _step(ref, family, latents, text)
    assert torch.allclose(loss, want_loss, rtol=1e-5)
    assert all(torch.allclose(grads[k], want[k], rtol=1e-4, atol=1e-6) for k in want)
    assert precision.prepare_denoiser(torch.nn.Linear(2, 2), TrainConfig()) is not None
    with pytest.raises(ValueError, match="no repeated blocks"):
        precision.compile_blocks(torch.nn.Linear(2, 2))
