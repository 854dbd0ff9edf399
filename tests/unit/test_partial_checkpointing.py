"""train.checkpoint_fraction: checkpoint the first share of the blocks, run the rest plainly, same gradients."""

import pytest
import torch

from diffpipe.config import ModelConfig, TrainConfig
from diffpipe.families import get_family
from diffpipe.training import checkpointing


def _grads(family, fraction):
    torch.manual_seed(0)
    denoiser = family.load_denoiser()
    denoiser.requires_grad_(True)
    calls, func = [], None
    if fraction is not None:
        func = checkpointing.enable(denoiser, fraction)
        if func is not None:  # count what really ran under torch's checkpoint
            original = checkpointing.checkpoint
            checkpointing.checkpoint = lambda f, *a, **k: calls.append(f.__self__) or original(f, *a, **k)
    try:
        channels = family.load_vae().config.latent_channels
        latents = torch.randn(2, channels, 1, 8, 8, generator=torch.Generator().manual_seed(1))
        text = {k: v[:2] for k, v in _text(family).items()}
        for _ in range(2):  # the first pass learns the block order; the second uses the share
            calls.clear()
            denoiser.zero_grad()
            family.loss(denoiser, latents, text, torch.Generator().manual_seed(2)).mean().backward()
    finally:
        if fraction is not None and fraction < 1:
            checkpointing.checkpoint = original
    return {n: p.grad.clone() for n, p in denoiser.named_parameters()}, len(calls), func


def _text(family):
    encoders = family.load_text_encoders()
    return family.encode_text(encoders, ["a red circle", "a blue square"])


@pytest.mark.parametrize("name", ["sd", "flux"])
def test_a_share_of_the_blocks_is_checkpointed_with_the_same_gradients(name):
    family = get_family(ModelConfig(family=name))
    plain, _, _ = _grads(family, None)
    half, n_half, func = _grads(family, 0.5)
    assert func.chosen == -(-len(func.order) // 2) and len(func.order) >= 2
    assert n_half == func.chosen  # the second pass checkpointed exactly the first half of the blocks
    for k in plain:
        torch.testing.assert_close(half[k], plain[k], rtol=1e-5, atol=1e-6, msg=k)


def test_fraction_settings_are_checked():
    with pytest.raises(ValueError, match="pipeline_stages: 1"):
        TrainConfig(activation_checkpointing=True, checkpoint_fraction=0.5, pipeline_stages=2)
    with pytest.raises(ValueError):
        TrainConfig(checkpoint_fraction=0)
