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


@pytest.mark.parametrize(("variant", "expert"), [("2.1", None), ("2.2-5b", None), ("2.2-a14b", "low")])
def test_wan_layers_and_inputs_reproduce_the_loss(variant, expert):
    """Wan 2.1, 2.2 TI2V-5B (a timestep per token) and an A14B expert: layers equal forward, and
    layers + pipeline_inputs + the pipeline loss equal family.loss from the same generator state."""
    from diffpipe.config import ObjectiveConfig
    from diffpipe.training.pipeline import pipeline_loss_fn

    family = get_family(ModelConfig(family="wan", variant=variant, expert=expert))
    den = _with_lora(family)
    g = torch.Generator().manual_seed(0)
    ch = den.config.in_channels
    latents, text = torch.randn(2, ch, 2, 4, 6, generator=g), {"prompt_embeds": torch.randn(2, 8, 32, generator=g)}
    layers = family.pipeline_layers(den)
    assert len(layers) == 1 + 2 + 1  # embed, 2 blocks, out
    o = ObjectiveConfig()
    with torch.no_grad():
        inputs, labels = family.pipeline_inputs(latents, text, torch.Generator().manual_seed(3), o)
        got_pred = run_layers(layers, inputs)
        ts = inputs[1][:, None].expand(2, 2 * 2 * 3) if family.expand_timesteps else inputs[1]
        want_pred = den(hidden_states=inputs[0], timestep=ts, encoder_hidden_states=inputs[2], return_dict=False)[0]
        torch.testing.assert_close(got_pred, want_pred)
        want = family.loss(den, latents, text, torch.Generator().manual_seed(3), objective=o).mean()
        torch.testing.assert_close(pipeline_loss_fn(o)(got_pred, labels), want)
    if expert == "low":  # the low expert only ever sees timesteps below the boundary
        assert (inputs[1] < family.boundary_ratio * 1000).all()


@pytest.mark.parametrize("name", ["cogvideox", "hunyuanvideo", "ltxvideo", pytest.param(
    "mochi", marks=pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning"))])  # Mochi's rope
def test_video_layers_equal_forward_and_reproduce_the_loss(name):
    """Video families: the layers' prediction equals the transformer's, and pipeline_inputs + the
    pipeline loss equal family.loss, from the same generator state (real text embeddings and masks)."""
    from diffpipe.config import ObjectiveConfig
    from diffpipe.training.pipeline import pipeline_loss_fn

    family = get_family(ModelConfig(family=name))
    den = _with_lora(family)
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(2, den.config.in_channels, 2, 4, 6, generator=g)
    text = family.encode_text(family.load_text_encoders(), ["a red circle", "a blue square moving left to right"])
    o = ObjectiveConfig(min_snr_gamma=5.0) if name == "cogvideox" else ObjectiveConfig()
    preds = []
    handle = den.register_forward_hook(lambda m, a, out: preds.append(out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        want = family.loss(den, latents, text, torch.Generator().manual_seed(3), objective=o).mean()
        inputs, labels = family.pipeline_inputs(latents, text, torch.Generator().manual_seed(3), o)
        layers = family.pipeline_layers(den)
        got_pred = run_layers(layers, inputs)
        got = pipeline_loss_fn(o)(got_pred, labels)
    handle.remove()
    blocks = [*den.transformer_blocks, *getattr(den, "single_transformer_blocks", [])]
    assert len(layers) == len(blocks) + 2
    torch.testing.assert_close(got_pred, preds[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want)


def test_cogvideox_layers_with_sincos_positions():
    """CogVideoX-2b-style models (sin-cos positions, no rotary embedding) through the same layers."""
    from diffusers import CogVideoXTransformer3DModel

    from diffpipe.models.cogvideox import TINY_TRANSFORMER

    family = get_family(ModelConfig(family="cogvideox"))
    torch.manual_seed(0)
    tr = CogVideoXTransformer3DModel(**{**TINY_TRANSFORMER, "use_rotary_positional_embeddings": False}).eval()
    g = torch.Generator().manual_seed(0)
    noisy, context = torch.randn(2, 3, 4, 4, 6, generator=g), torch.randn(2, 64, 32, generator=g)
    steps, empty = torch.tensor([100, 900]), torch.empty(0)
    with torch.no_grad():
        want = tr(hidden_states=noisy, encoder_hidden_states=context, timestep=steps, return_dict=False)[0]
        got = run_layers(family.pipeline_layers(tr), (noisy, context, steps, empty, empty))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_cogview4_layers_equal_forward():
    """CogView4: embedding, blocks, output (LoRA inside) equal the transformer's forward."""
    family = get_family(ModelConfig(family="cogview4"))
    tr = _with_lora(family)
    g = torch.Generator().manual_seed(0)
    noisy, context = torch.randn(2, 4, 8, 12, generator=g), torch.randn(2, 32, 32, generator=g)
    steps, size, crop = torch.tensor([300.0, 800.0]), torch.tensor([[64.0, 96.0]] * 2), torch.zeros(2, 2)
    layers = family.pipeline_layers(tr)
    assert len(layers) == len(tr.transformer_blocks) + 2
    with torch.no_grad():
        want = tr(hidden_states=noisy, encoder_hidden_states=context, timestep=steps, original_size=size,
                  target_size=size, crop_coords=crop, return_dict=False)[0]
        got = run_layers(layers, (noisy, steps, context, size, size, crop))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("extra_pos", [None, "learnable"])
def test_cosmos2_layers_equal_forward(extra_pos):
    """Cosmos-Predict2 (no learnable positions) and the learnable-position variant: layers equal forward."""
    from diffusers import CosmosTransformer3DModel

    from diffpipe.models.cosmos2 import TINY_TRANSFORMER

    family = get_family(ModelConfig(family="cosmos2"))
    torch.manual_seed(0)
    tr = CosmosTransformer3DModel(**{**TINY_TRANSFORMER, "extra_pos_embed_type": extra_pos}).eval()
    adapter.add_lora(tr, adapter.peft_config(LoraConfig(rank=4), family.lora_targets(None)))
    with torch.no_grad():
        for n, p in tr.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    g = torch.Generator().manual_seed(0)
    noisy, context = torch.randn(2, 16, 1, 8, 12, generator=g), torch.randn(2, 32, 32, generator=g)
    t, padding = torch.tensor([0.3, 0.8]), torch.zeros(1, 1, 8, 12)
    layers = family.pipeline_layers(tr)
    assert len(layers) == len(tr.transformer_blocks) + 2
    with torch.no_grad():
        want = tr(hidden_states=noisy, timestep=t, encoder_hidden_states=context, padding_mask=padding,
                  return_dict=False)[0]
        got = run_layers(layers, (noisy, t, context, padding))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
