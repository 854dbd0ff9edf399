"""The families' pipeline layer lists equal the denoisers' own forward; stage splits balance."""

import pytest
import torch
from diffusers import FluxPipeline

from diffpipe.config import LoraConfig, ModelConfig
from diffpipe.models import get_family
from diffpipe.models.pipeline_layers import run_layers
from diffpipe.training import adapter
from diffpipe.training.pipeline import balanced_split, layer_sizes, manual_split


def _with_lora(family):
    den = family.load_denoiser()
    torch.manual_seed(0)
    adapter.add_lora(den, adapter.peft_config(LoraConfig(rank=4), family.lora_targets(None)))
    with torch.no_grad():  # a non-zero LoRA, so it must be inside the layers
        for n, p in den.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return den.eval()


def test_sd_layers_equal_forward():
    family = get_family(ModelConfig(family="sd"))
    unet = _with_lora(family)
    g = torch.Generator().manual_seed(0)
    x, ctx, t = torch.randn(2, 4, 16, 16, generator=g), torch.randn(2, 77, 32, generator=g), torch.tensor([10, 700])
    layers = family.pipeline_layers(unet)
    assert len(layers) == 1 + 2 + 1 + 2 + 1  # embed, 2 down, mid, 2 up, out
    with torch.no_grad():
        torch.testing.assert_close(run_layers(layers, (x, t, ctx)),
                                   unet(x, t, encoder_hidden_states=ctx, return_dict=False)[0])


def test_flux_layers_equal_forward():
    family = get_family(ModelConfig(family="flux"))
    tr = _with_lora(family)
    g = torch.Generator().manual_seed(0)
    b, h, w = 2, 8, 8
    hidden = torch.randn(b, h * w // 4, 4, generator=g)
    sigma, guidance = torch.tensor([0.3, 0.8]), torch.ones(b)
    pooled, ctx = torch.randn(b, 32, generator=g), torch.randn(b, 32, 32, generator=g)
    txt_ids, img_ids = torch.zeros(32, 3), FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, "cpu", torch.float32)
    layers = family.pipeline_layers(tr)
    assert len(layers) == 1 + 1 + 1 + 1
    with torch.no_grad():
        want = tr(hidden_states=hidden, timestep=sigma, guidance=guidance, pooled_projections=pooled,
                  encoder_hidden_states=ctx, txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        got = run_layers(layers, (hidden, sigma, guidance, pooled, ctx, txt_ids, img_ids))
    torch.testing.assert_close(got, want)


def test_balanced_split_counts_frozen_weights():
    family = get_family(ModelConfig(family="sd"))
    sizes = layer_sizes(family.pipeline_layers(_with_lora(family)))
    assert sum(sizes) == sum(p.numel() for p in _with_lora(family).parameters())
    bounds = balanced_split(sizes, 2)
    stage = [sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    assert len(stage) == 2 and max(stage) < 0.75 * sum(sizes)
    assert balanced_split([5, 1, 1, 1, 1, 1], 2) == [0, 1, 6]
    assert balanced_split([1, 1, 1, 1], 4) == [0, 1, 2, 3, 4]
    assert balanced_split([100, 1, 1], 3) == [0, 1, 2, 3]
    assert manual_split([3], 7, 2) == [0, 3, 7]
    with pytest.raises(ValueError, match="increasing layer indices"):
        manual_split([0], 7, 2)


@pytest.mark.parametrize("name", ["sd", "flux"])
def test_pipeline_inputs_reproduce_the_loss(name):
    """Layers + pipeline_inputs + the pipeline loss = family.loss, from the same generator state."""
    from diffpipe.config import ObjectiveConfig
    from diffpipe.training.pipeline import pipeline_loss_fn

    family = get_family(ModelConfig(family=name))
    den = _with_lora(family)
    ch, seq = (4, 77) if name == "sd" else (1, 32)
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(2, ch, 1, 16, 16, generator=g)
    text = {"prompt_embeds": torch.randn(2, seq, 32, generator=g), "pooled_prompt_embeds": torch.randn(2, 32)}
    o = ObjectiveConfig(min_snr_gamma=5.0) if name == "sd" else ObjectiveConfig()
    with torch.no_grad():
        want = family.loss(den, latents, text, torch.Generator().manual_seed(3), objective=o).mean()
        inputs, labels = family.pipeline_inputs(latents, text, torch.Generator().manual_seed(3), o)
        got = pipeline_loss_fn(o)(run_layers(family.pipeline_layers(den), inputs), labels)
    torch.testing.assert_close(got, want)
