"""Loading the denoiser tensor by tensor (issue #40 item 3): a streamed, quantised-as-read denoiser is the
model that loading whole and quantising after the LoRA gives, tensor for tensor and dtype for dtype."""

from __future__ import annotations

import pytest
import torch

from diffpipe.config import ModelConfig, TrainConfig
from diffpipe.families import get_family
from diffpipe.models import streaming
from diffpipe.training import adapter, checkpointing, load, offload, precision


def _save(name: str, tmp_path_factory) -> tuple[str, object]:
    """A tiny denoiser saved as a local folder's denoiser subfolder: (family name, folder)."""
    family = get_family(ModelConfig(family=name))
    folder = tmp_path_factory.mktemp(name)
    family.load_denoiser().save_pretrained(folder / family.streamed_denoiser()[1])
    family.load_vae().save_config(folder / "vae")  # Wan tells its version by the VAE's config
    return name, folder


@pytest.fixture(scope="module", params=["flux", "qwenimage", "wan"])
def saved(request, tmp_path_factory):
    return _save(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def saved_flux(tmp_path_factory):
    return _save("flux", tmp_path_factory)


def _flat(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """A tensor's plain parts: itself, or a tensor subclass's inner tensors (torchao's int8 and NF4)."""
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return {"": t.detach()}
    names, _ = t.__tensor_flatten__()
    return {f".{n}{k}": v for n in names for k, v in _flat(getattr(t, n)).items()}


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        out |= {f"{name}:{type(t).__name__}{k}": v for k, v in _flat(t).items()}
    return out


def _trained(family, tc: TrainConfig, streamed: bool) -> torch.nn.Module:
    """The denoiser as the trainer sets it up: loaded (whole or streamed), LoRA added, base weights stored."""
    torch.manual_seed(0)
    loaded = load.load_denoiser(family, tc, torch.device("cpu")) if streamed else None
    den = loaded.module if streamed else family.load_denoiser()
    adapter.add_lora(den, adapter.peft_config(tc.lora, family.lora_targets(tc.lora.targets)))
    precision.prepare_denoiser(den, tc, quantise=not (streamed and loaded.quantised))
    return den


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("base_weights", ["auto", "fp8", "int8", "nf4"])
def test_streamed_quantised_denoiser_equals_load_then_quantise(saved, base_weights, dtype):
    name, folder = saved
    family = get_family(ModelConfig(family=name, flavor="local", path=str(folder), dtype=dtype))
    tc = TrainConfig(base_weights=base_weights, precision="bf16" if dtype == "bfloat16" else "fp32")
    assert load.why_whole(family) is None
    whole, streamed = _state(_trained(family, tc, False)), _state(_trained(family, tc, True))
    assert whole.keys() == streamed.keys()
    for key, value in whole.items():
        assert value.dtype == streamed[key].dtype and torch.equal(value, streamed[key]), key
    if base_weights != "auto":
        quantised = [k for k, v in whole.items() if v.dtype in (torch.uint8, torch.int8)]
        assert quantised  # the comparison covered stored 8- and 4-bit codes


def test_streamed_load_refuses_a_file_of_another_model(saved, tmp_path):
    name, folder = saved
    family = get_family(ModelConfig(family=name))
    model = family.load_denoiser()
    sd = model.state_dict()
    key = next(iter(sd))
    from safetensors.torch import save_file
    file = tmp_path / "diffusion_pytorch_model.safetensors"
    save_file({k: v for k, v in sd.items() if k != key} | {"stray.weight": torch.zeros(2)}, str(file))
    empty = streaming.empty_model(type(model), dict(model.config), torch.float32)
    with pytest.raises(ValueError, match=r"1 tensor\(s\) missing .*1 unknown .*stray.weight"):
        streaming.stream_into(empty, [file], torch.float32, finish=lambda *a: None, place=lambda *a: None,
                              what="test")


def _swap_step(family, tiny, tc: TrainConfig, streamed: bool) -> tuple[list[torch.Tensor], offload.BlockSwap]:
    """The LoRA gradients of one checkpointed step with the last block swapped, set up as the trainer does."""
    torch.manual_seed(0)
    loaded = load.load_denoiser(family, tc, torch.device("cpu")) if streamed else None
    den = loaded.module if streamed else family.load_denoiser()
    held = offload.hold(den, tc.block_swap, torch.device("cpu")) if streamed else None
    params = adapter.add_lora(den, adapter.peft_config(tc.lora, family.lora_targets(tc.lora.targets)))
    checkpointing.enable(den, 1.0)
    precision.prepare_denoiser(den, tc, quantise=not (streamed and loaded.quantised))
    den.to(torch.bfloat16)  # as DeepSpeed's bf16 mode casts the module: the held homes follow
    for p in params:
        p.data = p.data.float()
    swap = offload.install(den, tc.block_swap, torch.device("cpu"), held=held)
    assert not held  # every home kept since the load went back in
    text = tiny.encode_text(tiny.load_text_encoders(), ["a red circle", "a blue square"])
    latents = torch.randn(2, 1, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    tiny.loss(den.train(), latents, text, torch.Generator().manual_seed(2)).float().mean().backward()
    return [p.grad.clone() for p in params], swap


@pytest.mark.parametrize("base_weights", ["auto", "fp8"])
def test_streamed_block_swap_keeps_homes_from_the_load_and_steps_alike(saved_flux, base_weights):
    """Streamed with block swap, the swapped blocks' tensors stay out of the model from the load to the swap's
    install (:func:`offload.hold`), cast as the engine casts the module, and the step's gradients are those of
    the whole load with block swap copying its homes from the model."""
    name, folder = saved_flux
    family = get_family(ModelConfig(family=name, flavor="local", path=str(folder)))
    tiny = get_family(ModelConfig(family=name))
    tc = TrainConfig(base_weights=base_weights, precision="bf16", block_swap=1, activation_checkpointing=True)
    whole, _ = _swap_step(family, tiny, tc, False)
    streamed, swap = _swap_step(family, tiny, tc, True)
    assert swap.onloads >= 2 and swap.cpu_bytes > 0
    assert all(torch.equal(a, b) for a, b in zip(whole, streamed, strict=True))


@pytest.fixture(scope="module")
def flux_swap():
    """FLUX.1-dev at 256 px, fp8, checkpointing (no block swapped: the planner swaps)."""
    from diffpipe.config import Config
    from diffpipe.estimate import estimate_memory

    cfg = Config.model_validate({"model": {"family": "flux"}, "datasets": [{"name": "d", "path": "data",
                                 "resolution": 256}], "train": {"batch_size": 1, "precision": "bf16",
                                 "base_weights": "fp8", "activation_checkpointing": True}})
    return estimate_memory(cfg, model="flux1-dev", rank=16)


def test_the_estimate_counts_the_loads_peaks_streamed_and_whole(flux_swap):
    from dataclasses import replace

    from diffpipe.estimate import GiB

    e = flux_swap.swapped(1000)  # every block swapped
    assert e.load_streamed and e.load_whole_bytes > 22 * GiB  # FLUX.1-dev's 11.9B parameters in bf16
    flight = load.FLIGHT["fp8"] * e.load_largest_bytes
    # Streamed: the swapped blocks and one tensor in flight in RAM; the resident rest on the GPU.
    assert e.load_ram_bytes == e.cpu_bytes + flight < 0.7 * e.load_whole_bytes
    assert e.load_gpu_bytes == e.frozen_bytes - e.cpu_bytes < e.total_bytes
    # Loaded whole (a family that builds its denoiser its own way): the bf16 model in RAM, every block on the GPU.
    whole = replace(e, load_streamed=False)
    assert whole.load_ram_bytes == e.load_whole_bytes + e.frozen_bytes + flight
    assert whole.load_gpu_bytes == e.frozen_bytes
    assert "load peak" in e.table() and e.as_dict()["load_ram_bytes"] == e.load_ram_bytes


def test_the_planner_refuses_a_swap_whose_load_does_not_fit(flux_swap):
    from dataclasses import replace

    from diffpipe import memory_plan as mp
    from diffpipe.estimate import GiB

    settings = {"base_weights": "fp8", "activation_checkpointing": True, "activation_offload": False}
    gpu = int(flux_swap.frozen_bytes - 1 * GiB)  # swapping blocks fits the step, not a whole load
    streamed, _ = mp._fit(settings, flux_swap, gpu, None, True)
    assert streamed is not None and streamed.estimate.total_bytes < gpu
    whole, (miss, closest) = mp._fit(settings, replace(flux_swap, load_streamed=False), gpu, None, True)
    assert whole is None and miss == flux_swap.frozen_bytes + mp.CONTEXT_BYTES - gpu
    # System RAM: the load's peak counts beside the swapped blocks.
    ram = streamed.estimate.load_ram_bytes
    assert ram > streamed.estimate.cpu_bytes and mp._fit(settings, flux_swap, gpu, ram - 1, True)[0] is None
