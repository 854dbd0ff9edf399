"""``diffpipe estimate`` accounts for fp8, int8 and nf4 storage, activation checkpointing, block swap and frames."""

from __future__ import annotations

import functools
import platform

import pytest
import torch

from diffpipe.config import Config
from diffpipe.estimate import GiB, estimate_memory
from diffpipe.families.published import PUBLISHED
from diffpipe.training import offload


def _cfg(family: str, resolution: int = 256, **train) -> Config:
    return Config.model_validate(
        {"model": {"family": family}, "datasets": [{"name": "d", "path": "data", "resolution": resolution}],
         "train": {"batch_size": 1, "precision": "bf16", **train}}
    )


@pytest.fixture(scope="module")
def flux(cached_estimate):
    """FLUX.1-dev at 1024 px, rank 16, under each option (shared with the planner's tests: tests/unit/conftest.py)."""
    options = {"bf16": {}, "fp8": {"base_weights": "fp8"}, "ckpt": {"activation_checkpointing": True},
               "fp8+ckpt": {"base_weights": "fp8", "activation_checkpointing": True},
               "swap": {"base_weights": "fp8", "activation_checkpointing": True, "block_swap": 1000},
               "offload": {"base_weights": "fp8", "activation_checkpointing": True, "activation_offload": True},
               "half": {"activation_checkpointing": True, "checkpoint_fraction": 0.5},
               "nf4+ckpt": {"base_weights": "nf4", "activation_checkpointing": True}}
    return {k: cached_estimate(_flux_cfg(**v), model="flux1-dev") for k, v in options.items()}


def _flux_cfg(**train) -> Config:
    """FLUX.1-dev's config as the memory planner's tests and the docs' fits table write it (rank 16, 1024 px)."""
    return _cfg("flux", 1024, lora={"rank": 16}, **train)


def test_checkpointing_keeps_block_inputs_and_one_block(flux):
    full, ckpt = flux["bf16"].activation_bytes, flux["ckpt"].activation_bytes
    assert ckpt < full / 5, (ckpt / GiB, full / GiB)
    # At least each of the 57 blocks' input hidden states (4096 image + 512 text tokens x 3072, bf16).
    assert ckpt > 57 * 4096 * 3072 * 2
    assert flux["ckpt"].activation_checkpointing and not flux["bf16"].activation_checkpointing


def test_fp8_counts_one_byte_per_stored_weight_and_its_scales(flux):
    from diffpipe.training.precision import ScaledFp8Linear

    layers = [m for m in _fp8_model().modules() if isinstance(m, ScaledFp8Linear)]
    cast = sum(m.weight.numel() for m in layers)
    scales = sum(m.weight_scale.nbytes for m in layers)  # a bf16 scale per output channel
    saved = flux["bf16"].param_bytes - flux["fp8"].param_bytes  # one byte per float8 weight, less the scales
    # diffusers' default skip patterns keep the AdaLN modulations (``norm*.linear``) in bf16: 27% of Flux.
    assert saved == cast - scales and 0.7 * flux["bf16"].params < cast < 0.8 * flux["bf16"].params
    # The matmul saves the codes (weights), not a bf16 copy: the activations are bf16's plus one layer's
    # transient dequantised weight.
    largest = max(m.weight.numel() for m in layers) * 2
    assert flux["fp8"].activation_bytes == flux["bf16"].activation_bytes + largest
    assert flux["fp8+ckpt"].activation_bytes == flux["ckpt"].activation_bytes + largest
    assert flux["fp8+ckpt"].total_bytes < 0.55 * flux["bf16"].total_bytes


def test_int8_counts_torchaos_bytes_of_the_fp8_layers(flux, cached_estimate):
    """int8 stores the layers fp8 casts, at torchao's real size (checked on a quantised tiny model)."""
    import peft

    from diffpipe.families import get_family
    from diffpipe.training.precision import enable_quantised_base_weights

    int8 = cached_estimate(_flux_cfg(base_weights="int8"), model="flux1-dev")
    cast = _fp8_weights()
    rows = sum(p.shape[0] for p in cast)
    assert flux["bf16"].param_bytes - int8.param_bytes == sum(p.numel() for p in cast) - 4 * rows
    # Each matmul saves its bf16 weight copy for the backward pass.
    assert int8.activation_bytes > flux["bf16"].activation_bytes + 0.95 * sum(2 * p.numel() for p in cast)
    # torchao's layout: int8 values and a float32 scale per output channel, as the estimate counts them.
    family = get_family(_cfg("flux").model.model_copy(update={"flavor": "tiny"}))
    tiny = family.load_denoiser().to(torch.bfloat16).requires_grad_(False)
    tiny.add_adapter(peft.LoraConfig(r=4, lora_alpha=4, target_modules=family.lora_targets(None)))
    before = {n: (b.numel(), b.shape[0]) for n, b in tiny.named_parameters() if not b.requires_grad}
    enable_quantised_base_weights(tiny, torch.bfloat16, "int8")
    quantised = {n: b for n, b in tiny.named_buffers() if type(b).__name__ == "Int8Tensor"}
    assert quantised and all(n in before for n in quantised)
    for name, b in quantised.items():
        assert b.qdata.dtype == torch.int8 and b.qdata.numel() + 4 * b.scale.numel() == before[name][0] + 4 * before[name][1]


def test_nf4_counts_its_bytes_and_no_saved_weight_copies(flux, cached_estimate):
    """nf4 stores the same layers as fp8 at NF4's size, and saves no dequantised copy for the backward
    pass (its autograd function keeps the 4-bit weight), so its activations are bf16's."""
    from diffpipe.training.precision import nf4_bytes, nf4_dequantise_bytes

    nf4 = cached_estimate(_flux_cfg(base_weights="nf4"), model="flux1-dev")
    cast = _fp8_weights()
    assert flux["bf16"].param_bytes - nf4.param_bytes == sum(2 * w.numel() - nf4_bytes(w.numel(), 2) for w in cast)
    # Plus the largest layer's dequantisation temporaries (a single block's proj_out, 15360 x 3072).
    assert nf4.activation_bytes == flux["bf16"].activation_bytes + nf4_dequantise_bytes(15360 * 3072, 2)
    # About 0.52 bytes per quantised weight; the AdaLN modulations (27%) stay bf16 as under fp8, so
    # FLUX.1-dev's weights drop to 46% of bf16's.
    assert 0.4 * flux["bf16"].param_bytes < nf4.param_bytes < 0.5 * flux["bf16"].param_bytes
    assert nf4.total_bytes < flux["bf16"].total_bytes - 0.5 * flux["bf16"].param_bytes


def test_block_swap_leaves_two_blocks_resident(flux):
    fp8, swap = flux["fp8+ckpt"], flux["swap"]
    blocks = offload.swap_blocks(_fp8_model())
    assert swap.cpu_bytes == sum(t.nbytes for b in blocks for t in offload.frozen_tensors(b))
    assert swap.cpu_bytes > 0.9 * (fp8.param_bytes - 0.5 * GiB)  # nearly every weight is in a block
    # The block that runs and the next one, whose copy is prefetched meanwhile.
    sizes = sorted(sum(t.nbytes for t in offload.frozen_tensors(b)) for b in offload.swap_blocks(_fp8_model()))
    assert swap.param_bytes == fp8.param_bytes - swap.cpu_bytes + sizes[-1] + sizes[-2]
    assert swap.total_bytes < 5 * GiB and "blocks swapped" in swap.table()


def test_activation_offload_moves_the_block_inputs_to_system_ram(flux):
    ckpt, off = flux["fp8+ckpt"], flux["offload"]
    # On the GPU: one block's activations while it is recomputed; in system RAM: what checkpointing keeps.
    assert off.activation_bytes < ckpt.activation_bytes / 2, (off.activation_bytes / GiB, ckpt.activation_bytes / GiB)
    assert off.activation_bytes + off.activation_cpu_bytes == ckpt.activation_bytes
    assert off.activation_cpu_bytes > 57 * 4096 * 3072 * 2  # the 57 blocks' image-token inputs, at least
    assert off.param_bytes == ckpt.param_bytes and ckpt.activation_cpu_bytes == 0
    assert "activations offloaded" in off.table() and "activations offloaded" not in ckpt.table()


def _fp8_weights() -> list[torch.Tensor]:
    """The e4m3 codes of every layer ``base_weights: fp8`` stores (int8 and nf4 store the same layers)."""
    from diffpipe.training.precision import ScaledFp8Linear

    return [m.weight for m in _fp8_model().modules() if isinstance(m, ScaledFp8Linear)]


@functools.cache  # built once (about a second): the tests only read it, and on meta it holds no memory
def _fp8_model():
    import peft

    from diffpipe.families import get_family
    from diffpipe.training.precision import enable_fp8_base_weights

    meta = PUBLISHED["flux1-dev"].build_meta().to(torch.bfloat16).requires_grad_(False)
    family = get_family(_cfg("flux").model)
    meta.add_adapter(peft.LoraConfig(r=16, lora_alpha=16, target_modules=family.lora_targets(None)))
    enable_fp8_base_weights(meta.to(torch.bfloat16))
    return meta


def test_video_frames_and_height_scale_activations():
    cfg = _cfg("wan", 256)
    one = estimate_memory(cfg, model="wan2.1-t2v-1.3b", rank=16, frames=1)
    nine = estimate_memory(cfg, model="wan2.1-t2v-1.3b", rank=16, frames=9)  # 3 latent frames
    assert 2.5 * one.activation_bytes < nine.activation_bytes < 3.5 * one.activation_bytes
    wide = estimate_memory(cfg, model="wan2.1-t2v-1.3b", rank=16, frames=1, resolution=512, height=256)
    assert 1.7 * one.activation_bytes < wide.activation_bytes < 2.3 * one.activation_bytes
    assert "x 9 frames" in nine.table() and "512x256" in wide.table()
    with pytest.raises(ValueError, match="4k\\+1"):
        estimate_memory(cfg, model="wan2.1-t2v-1.3b", frames=8)


def test_a_share_of_checkpointed_blocks_lies_between_none_and_all(flux):
    none, half, every = (flux[k].activation_bytes for k in ("bf16", "half", "ckpt"))
    assert every < half < none
    # Half of Flux's 57 blocks keep their saves: about half of what checkpointing every block saves.
    assert 0.3 < (none - half) / (none - every) < 0.7, ((none - half) / GiB, (none - every) / GiB)


def test_bf16_optimizers_have_no_float32_master_copy(flux, cached_estimate):
    plain = flux["bf16"]  # optimizer state does not depend on the resolution: a small one suffices here
    kahan = cached_estimate(_cfg("flux", 64, optimizer="adamw_kahan", zero_stage=1), model="flux1-dev", rank=16)
    trainable = (plain.optimizer_bytes) // 12  # AdamW under bf16: m, v and the float32 master, 4 bytes each
    assert kahan.optimizer_bytes == trainable * 10  # m, v (float32) and the bf16 Kahan compensation


@pytest.mark.parametrize("name", ["adamw8bit", "adamw4bit"])
def test_quantised_state_bytes_are_torchaos_own(name):
    """The estimate's bytes per tensor equal what torchao's optimizer allocates (codes, block scales, code
    table; full-width moments under 4096 values or off the block)."""
    from diffpipe.config import TrainConfig
    from diffpipe.estimate import quantised_state_bytes
    from diffpipe.training.optim import build_optimizer

    for numel in (65536, 1000, 4096 + 64):
        p = torch.nn.Parameter(torch.zeros(numel))
        opt = build_optimizer([p], TrainConfig(optimizer=name))
        p.grad = torch.ones(numel)
        opt.step()
        real = sum(sum(t.nbytes for t in (getattr(s, a) for a in s.__tensor_flatten__()[0])) if hasattr(s, "codes")
                   else s.nbytes for s in (opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]))
        assert quantised_state_bytes(numel, name, 4) == real, numel


def test_full_fine_tune_with_quantised_states_in_the_backward_pass(cached_estimate):
    """FLUX.1-dev full fine-tuning: 8-bit moments take about 2 bytes per parameter instead of 8, 4-bit about 1;
    stepped in the backward pass, one gradient (the largest parameter's) is held instead of all, and the bf16
    weights are stepped themselves (no float32 master copy)."""
    def est(**train):  # one denoiser and one forward for the four (the session's Reuse)
        return cached_estimate(_cfg("flux", 64, mode="full", **train), model="flux1-dev")

    from diffpipe.estimate import quantised_state_bytes

    plain, q8 = est(), est(optimizer="adamw8bit")
    n = plain.trainable
    sizes = [p.numel() for p in PUBLISHED["flux1-dev"].build_meta().parameters()]
    largest = max(sizes)
    assert plain.optimizer_bytes == 12 * n  # m, v, float32 master
    assert plain.grad_bytes == 6 * n  # bf16 gradients and DeepSpeed's float32 copies of them
    # 8-bit m and v of the float32 master copy, the master itself, one tensor's step workspace (8 B per value)
    assert q8.optimizer_bytes == sum(quantised_state_bytes(k, "adamw8bit", 4) for k in sizes) + 4 * n + 8 * largest
    assert 6.0 < q8.optimizer_bytes / n < 6.1 and q8.grad_bytes == plain.grad_bytes
    for name, per_param, work in (("adamw8bit", (2.0, 2.1), 8), ("adamw4bit", (1.0, 1.2), 26)):
        inb = est(optimizer=name, optimizer_in_backward=True, grad_clip=0)
        assert inb.grad_bytes == 2 * largest
        # moments of the bf16 weights themselves (no master): full-width ones are bf16
        assert inb.optimizer_bytes == sum(quantised_state_bytes(k, name, 2) for k in sizes) + work * largest
        assert per_param[0] < inb.optimizer_bytes / n < per_param[1]
        assert inb.param_bytes == plain.param_bytes and inb.optimizer_in_backward
    assert "stepped in the backward pass" in inb.table()


#: Settings in an order that reuses every part an estimate shares and rebuilds one (fp8's denoiser after
#: int8's took its place), with a full fine-tune and another LoRA rank among them.
_SHARED = [{}, {"activation_checkpointing": True}, {"base_weights": "nf4"},
           {"base_weights": "fp8", "activation_checkpointing": True, "activation_offload": True},
           {"base_weights": "int8", "activation_checkpointing": True, "checkpoint_fraction": 0.5},
           {"base_weights": "fp8", "block_swap": 2, "activation_checkpointing": True},
           {"base_weights": "nf4", "activation_checkpointing": True},
           {"base_weights": "fp8", "lora": {"rank": 4}, "zero_stage": 2},
           {"mode": "full", "optimizer": "adamw8bit", "optimizer_in_backward": True, "grad_clip": 0},
           {"base_weights": "int8", "activation_offload": True, "activation_checkpointing": True}]


def test_estimates_sharing_a_reuse_equal_estimates_made_alone(shallow_flux):
    """A memory plan's estimates share their meta denoisers and traced forwards (diffpipe.meta_denoiser.Reuse):
    each equals the estimate made alone, whatever was estimated before it."""
    from diffpipe.estimate import estimate_for
    from diffpipe.meta_denoiser import Reuse

    with Reuse() as reuse:
        for train in _SHARED:
            for sizes in ({}, {"resolution": 512, "height": 256, "gpus": 2}):
                cfg = _cfg("flux", 256, **train)
                shared = estimate_for(cfg, shallow_flux, reuse=reuse, **sizes)
                assert shared == estimate_for(cfg, shallow_flux, **sizes), (train, sizes)


def test_one_forward_counts_each_way_of_checkpointing_as_its_own_forward(shallow_flux):
    """The estimate counts the saves with checkpointing and without from one forward (saved_bytes_each): each
    way's figures equal those of a forward of its own."""
    from diffpipe.estimate import Forward, _meta_forward
    from diffpipe.families import get_family
    from diffpipe.meta_denoiser import Build, Trainable, module_kind
    from diffpipe.saved_activations import saved_bytes, saved_bytes_each

    tc = _cfg("flux", 256).train
    family = get_family(_cfg("flux").model.model_copy(update={"flavor": "tiny"}))
    ways = [(False, 1.0), (True, 1.0), (True, 0.5)]
    for base in ("auto", "fp8", "int8"):
        trainable = Trainable(16, tuple(family.lora_targets(None)))
        build = Build(shallow_flux, torch.bfloat16, trainable, module_kind(base, trainable))
        module = build.convert(build.plain()[0])
        fw = Forward(family.cfg, 1, 256, 256, 1, 1, tc.objective, None, False, 1.0)
        run = _meta_forward(family, shallow_flux, module, fw, torch.bfloat16)
        alone = [saved_bytes(module, run, checkpointing=c, fraction=f) for c, f in ways]
        assert saved_bytes_each(module, run, ways) == alone and alone[0] != alone[1] != alone[2], base


def test_a_reuse_holds_two_denoisers_at_most_and_none_once_closed(monkeypatch, shallow_flux):
    """Whatever it serves, a Reuse holds the latest plain denoiser and one converted copy; closed, none."""
    import copy
    import gc
    import types
    import weakref

    from diffpipe import meta_denoiser
    from diffpipe.estimate import estimate_for
    from diffpipe.meta_denoiser import Reuse

    made = []  # the converted copies, weakly

    def deepcopy(module):
        made.append(weakref.ref(out := copy.deepcopy(module)))
        return out

    monkeypatch.setattr(meta_denoiser, "copy", types.SimpleNamespace(deepcopy=deepcopy))
    with Reuse() as reuse:
        for base, side in (("auto", 256), ("fp8", 256), ("int8", 256), ("nf4", 256), ("fp8", 512)):
            estimate_for(_cfg("flux", side, base_weights=base), shallow_flux, reuse=reuse)
        gc.collect()
        # fp8 at a new size needs its denoiser again, copied anew: int8's copy was dropped for it.
        assert len(made) == 3 and sum(ref() is not None for ref in made) == 1
    gc.collect()
    assert all(ref() is None for ref in made)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's; elsewhere nothing to return")
def test_release_freed_memory_hands_the_freed_heap_back():
    """glibc keeps the pages of freed small allocations below a live one (a dropped meta denoiser's objects:
    about 130 MB per FLUX.1-dev estimate); release_freed_memory, which a Reuse calls when closed, returns them."""
    from pathlib import Path

    from diffpipe.meta_denoiser import release_freed_memory

    def rss() -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024

    blocks = [bytearray(1000) for _ in range(200_000)]  # 200 MB of heap
    pinned = bytearray(1000)  # allocated above them: glibc cannot simply shrink the heap's top
    before = rss()
    del blocks
    kept = rss()
    release_freed_memory()
    assert before - kept < 50 * 2**20 < kept - rss(), (before, kept, rss())
    del pinned
