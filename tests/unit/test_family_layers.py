"""Pipeline-parallel layer lists of the newer transformer families equal their forward."""

from __future__ import annotations

import pytest
import torch

from diffpipe.config import ModelConfig
from diffpipe.families import get_family
from diffpipe.models.layers import run_layers


def test_sd3_layers_equal_forward():
    family = get_family(ModelConfig(family="sd3"))
    tr = family.load_denoiser()
    g = torch.Generator().manual_seed(0)
    noisy = torch.randn(2, 4, 16, 12, generator=g)
    timestep = torch.tensor([300.0, 700.0])
    pooled = torch.randn(2, 64, generator=g)
    context = torch.randn(2, 9, 64, generator=g)
    with torch.no_grad():
        expected = tr(hidden_states=noisy, timestep=timestep, pooled_projections=pooled,
                      encoder_hidden_states=context, return_dict=False)[0]
        layers = family.pipeline_layers(tr)
        got = run_layers(layers, (noisy, timestep, pooled, context))
    assert len(layers) == len(tr.transformer_blocks) + 2
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_qwenimage_layers_equal_forward():
    family = get_family(ModelConfig(family="qwenimage"))
    tr = family.load_denoiser()
    g = torch.Generator().manual_seed(0)
    packed = torch.randn(2, 12, 16, generator=g)  # a 3x4 grid of 2x2-packed 4-channel latents
    sigma = torch.tensor([0.3, 0.8])
    context = torch.randn(2, 7, 32, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        expected = tr(hidden_states=packed, timestep=sigma, encoder_hidden_states=context,
                      encoder_hidden_states_mask=mask, img_shapes=[[(1, 3, 4)]] * 2, return_dict=False)[0]
        layers = family.pipeline_layers(tr)
        got = run_layers(layers, (packed, sigma, context, mask, torch.tensor([1, 3, 4])))
    assert len(layers) == len(tr.transformer_blocks) + 2
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_chroma_layers_equal_forward():
    family = get_family(ModelConfig(family="chroma"))
    from diffusers import ChromaTransformer2DModel

    from diffpipe.families.chroma.flavors import TINY_TRANSFORMER

    torch.manual_seed(0)  # two blocks of each kind, so the modulation offsets matter
    tr = ChromaTransformer2DModel(**{**TINY_TRANSFORMER, "num_layers": 2, "num_single_layers": 2}).eval()
    g = torch.Generator().manual_seed(0)
    packed = torch.randn(2, 12, 4, generator=g)
    sigma = torch.tensor([0.3, 0.8])
    context = torch.randn(2, 5, 32, generator=g)
    txt_ids, img_ids = torch.zeros(5, 3), torch.randn(12, 3, generator=g)
    mask = torch.ones(2, 17)
    mask[0, 3:5] = 0
    with torch.no_grad():
        expected = tr(hidden_states=packed, timestep=sigma, encoder_hidden_states=context, txt_ids=txt_ids,
                      img_ids=img_ids, attention_mask=mask, return_dict=False)[0]
        got = run_layers(family.pipeline_layers(tr), (packed, sigma, context, txt_ids, img_ids, mask))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_hidream_layers_equal_forward():
    from diffusers import HiDreamImageTransformer2DModel

    from diffpipe.families.hidream.flavors import TINY_TRANSFORMER

    torch.manual_seed(0)  # two blocks of each kind, so the per-block Llama states matter
    config = {**TINY_TRANSFORMER, "num_layers": 2, "num_single_layers": 2, "llama_layers": [0, 1, 1, 0]}
    tr = HiDreamImageTransformer2DModel(**config).eval()
    family = get_family(ModelConfig(family="hidream"))
    g = torch.Generator().manual_seed(0)
    t5, llama, pooled = torch.randn(2, 6, 32, generator=g), torch.randn(2, 2, 5, 32, generator=g), torch.randn(2, 64)
    for h, w in [(16, 16), (16, 24)]:  # square, and padded to max_seq
        noisy, steps = torch.randn(2, 4, h, w, generator=g), torch.tensor([300.0, 700.0])
        with torch.no_grad():
            expected = tr(hidden_states=noisy, timesteps=steps, encoder_hidden_states_t5=t5,
                          encoder_hidden_states_llama3=llama, pooled_embeds=pooled, return_dict=False)[0]
            got = run_layers(family.pipeline_layers(tr), (noisy, steps, t5, llama, pooled))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_zimage_layers_equal_forward_with_captions_of_different_lengths():
    """Z-Image's forward takes each caption at its own length (3 and 37 tokens: the unified sequences
    differ in length, so the blocks mask); the layers take them zero-padded with a mask."""
    from torch.nn.utils.rnn import pad_sequence

    family = get_family(ModelConfig(family="zimage"))
    tr = family.load_denoiser()
    g = torch.Generator().manual_seed(0)
    noisy = torch.randn(2, 4, 8, 12, generator=g)
    captions = [torch.randn(3, 32, generator=g), torch.randn(37, 32, generator=g)]
    keep = pad_sequence([torch.ones(len(c), dtype=torch.long) for c in captions], batch_first=True)
    t = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        expected = torch.stack(tr(list(noisy.unsqueeze(2).unbind(0)), t, captions, return_dict=False)[0]).squeeze(2)
        layers = family.pipeline_layers(tr)
        got = run_layers(layers, (noisy, t, pad_sequence(captions, batch_first=True), keep))
    assert len(layers) == len(tr.layers) + 2
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_lumina2_layers_equal_forward_with_prompts_of_different_lengths():
    """Lumina 2 packs each sample's caption and image tokens into one sequence of its own length:
    with 3 and 7 caption tokens the blocks must mask the shorter sample's padding as the model does."""
    family = get_family(ModelConfig(family="lumina2"))
    tr = family.load_denoiser()
    g = torch.Generator().manual_seed(0)
    noisy, context = torch.randn(2, 4, 8, 12, generator=g), torch.randn(2, 7, 32, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    t = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        expected = tr(noisy, t, context, mask, return_dict=False)[0]
        layers = family.pipeline_layers(tr)
        got = run_layers(layers, (noisy, t, context, mask))
    assert len(layers) == len(tr.layers) + 2
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["flux2-klein", "flux2"])
def test_flux2_layers_equal_forward_over_several_blocks(name):
    """Two double and two single blocks: each single-block layer re-joins and splits the streams, which
    must equal the forward's one join before the single blocks and one split after them. FLUX.2 [dev]
    (``flux2``) carries its distilled guidance in the first layer's tuple."""
    from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel

    family = get_family(ModelConfig(family=name))
    tiny = family.denoiser_model.tiny
    torch.manual_seed(0)
    tr = Flux2Transformer2DModel(**{**tiny, "num_layers": 2, "num_single_layers": 2}).eval()
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 16, 3, 4, generator=g)
    tokens = Flux2KleinPipeline._pack_latents(latents)
    context = torch.randn(2, 7, tiny["joint_attention_dim"], generator=g)
    txt_ids, img_ids = Flux2KleinPipeline._prepare_text_ids(context), Flux2KleinPipeline._prepare_latent_ids(latents)
    sigma = torch.tensor([0.3, 0.8])
    guidance = torch.tensor([1.0, 3.5]) if tiny["guidance_embeds"] else None
    with torch.no_grad():
        expected = tr(hidden_states=tokens, timestep=sigma, guidance=guidance, encoder_hidden_states=context,
                      txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        layers = family.pipeline_layers(tr)
        first = (tokens, sigma, *([guidance] if guidance is not None else []), context, txt_ids, img_ids)
        got = run_layers(layers, first)
    assert len(layers) == 2 + 2 + 2
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if guidance is not None:  # the guidance reaches the embedding
        other = run_layers(layers, (tokens, sigma, guidance + 1, context, txt_ids, img_ids))
        assert (other - got).abs().max() > 1e-4
