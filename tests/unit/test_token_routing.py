"""``train.token_routing``: the config's refusals, the block range checked against the model, the draws
seeded from the step (resume routes the same tokens), FLOPs counted with routing. The family-by-family
behaviour (keep 1 exact, skipped tokens bypass the blocks, evaluation on every token, gradients) is the
contract check ``token_routing`` in ``tests/family_contract.py``."""

from __future__ import annotations

import pytest
import torch

from diffpipe.config import ModelConfig, ObjectiveConfig
from diffpipe.config.base import ConfigError
from diffpipe.config.load import parse_config
from diffpipe.families import get_family
from diffpipe.models.routing import TokenRoute, route_generator, routed
from diffpipe.training.flops import counted


def _config(**train):
    return parse_config({"model": {"family": "flux"}, "datasets": [{"name": "a", "path": "data"}], "train": train})


def test_pipeline_stages_refused_by_name():
    with pytest.raises(ConfigError, match="token_routing needs train.pipeline_stages: 1"):
        _config(pipeline_stages=2, token_routing={"keep": 0.5, "start_block": 0, "end_block": 1})


def test_empty_block_range_refused():
    with pytest.raises(ConfigError, match="end_block 3 must be above start_block 3"):
        _config(token_routing={"keep": 0.5, "start_block": 3, "end_block": 3})


def test_family_without_a_stack_refused():
    with pytest.raises(ConfigError, match="model family 'sd' has no homogeneous block stack"):
        get_family(ModelConfig(family="sd")).check_token_routing(_config(
            token_routing={"end_block": 4}).train.token_routing)


def _flux_inputs():
    family = get_family(ModelConfig(family="flux"))
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 1, 1, 8, 8, generator=g)
    text = {"prompt_embeds": torch.randn(2, 5, 32, generator=g), "pooled_prompt_embeds": torch.randn(2, 32, generator=g)}
    return family, family.load_denoiser(), latents, text


def test_block_range_beyond_the_model_refused():
    family, tr, latents, text = _flux_inputs()  # tiny FLUX.1: 2 blocks
    with pytest.raises(ConfigError, match=r"not within this denoiser's 2 blocks"):
        family.loss(tr, latents, text, torch.Generator().manual_seed(1),
                    route=TokenRoute(0.5, 1, 3, torch.Generator()))


def test_routing_draws_follow_the_step():
    """A resumed run builds its routes from the step: the same kept tokens as the uninterrupted run."""
    a = TokenRoute(0.5, 0, 2, route_generator(7, 10, 0, 1)).kept(64, torch.device("cpu"))
    b = TokenRoute(0.5, 0, 2, route_generator(7, 10, 0, 1)).kept(64, torch.device("cpu"))
    c = TokenRoute(0.5, 0, 2, route_generator(7, 11, 0, 1)).kept(64, torch.device("cpu"))
    assert torch.equal(a, b) and not torch.equal(a, c) and len(a) == 32


def test_routing_counts_fewer_flops():
    family, tr, latents, text = _flux_inputs()

    def flops(route):
        with counted() as mode, routed(tr, family.routed_stack, route):
            family.predict(tr, family.prepare(latents, text, torch.Generator().manual_seed(1),
                                              objective=ObjectiveConfig()))
        return mode.get_total_flops()

    plain, half = flops(None), flops(TokenRoute(0.5, 0, 2, torch.Generator()))
    assert half < plain


def test_estimate_counts_the_routed_blocks_activations_at_keep():
    """FLUX.1-dev at 512 px: routing blocks 2..54 of 57 at keep 0.5 saves close to half of their activations."""
    from diffpipe.config import Config
    from diffpipe.estimate import estimate_memory

    def activations(**train):
        cfg = Config.model_validate({"model": {"family": "flux"},
                                     "datasets": [{"name": "d", "path": "data", "resolution": 512}],
                                     "train": {"batch_size": 1, "precision": "bf16", **train}})
        return estimate_memory(cfg, model="flux1-dev", rank=16).activation_bytes

    plain = activations()
    half = activations(token_routing={"keep": 0.5, "start_block": 2, "end_block": 55})
    # The image tokens are 1024 of each double block's 1536 and of the single blocks' 1536: the routed blocks
    # save roughly (512 + 512) / 1536 of their bytes; the others, embeddings and output keep theirs.
    assert 0.5 < half / plain < 0.85, half / plain
