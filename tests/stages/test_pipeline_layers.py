"""The families' pipeline layer lists equal the denoisers' own forward; stage splits balance."""

import pytest
import torch
from diffusers import FluxPipeline

from diffpipe.config import LoraConfig, ModelConfig
from diffpipe.families import get_family
from diffpipe.models.layers import run_layers
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


def _prediction(out):
    """A denoiser forward's prediction: the first of a tuple, an output's ``sample``; a list (Z-Image: one per
    image) stacked."""
    out = out[0] if isinstance(out, tuple) else getattr(out, "sample", out)
    return torch.stack(out).squeeze(2) if isinstance(out, list) else out


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


@pytest.mark.parametrize("name", ["cogvideox", "hunyuanvideo", "ltxvideo", "ltx2", "helios", pytest.param(
    "mochi", marks=pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning"))])  # Mochi's rope
def test_video_layers_equal_forward_and_reproduce_the_loss(name):
    """Video families: the layers' prediction equals the transformer's, and pipeline_inputs + the
    pipeline loss equal family.loss, from the same generator state (real text embeddings and masks)."""
    from diffpipe.config import ObjectiveConfig

    family = get_family(ModelConfig(family=name))
    den = _with_lora(family)
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(2, den.config.in_channels, 2, 4, 6, generator=g)
    text = family.encode_text(family.load_text_encoders(), ["a red circle", "a blue square moving left to right"])
    o = ObjectiveConfig(min_snr_gamma=5.0) if name == "cogvideox" else ObjectiveConfig()
    layers = _layers_reproduce_the_loss(family, den, latents, text, o)
    blocks = getattr(den, "blocks", None) or [*den.transformer_blocks, *getattr(den, "single_transformer_blocks", [])]
    assert len(layers) == len(blocks) + 2


def _layers_reproduce_the_loss(family, den, latents, text, o) -> list:
    """Check the layers' prediction equals the denoiser's and pipeline_inputs + the pipeline loss equal
    family.loss from the same generator state; returns the layers."""
    from diffpipe.training.pipeline import pipeline_loss_fn

    preds = []
    handle = den.register_forward_hook(lambda m, a, out: preds.append(_prediction(out)))
    with torch.no_grad():
        want = family.loss(den, latents, text, torch.Generator().manual_seed(3), objective=o).mean()
        inputs, labels = family.pipeline_inputs(latents, text, torch.Generator().manual_seed(3), o)
        layers = family.pipeline_layers(den)
        got_pred = run_layers(layers, inputs)
        got = pipeline_loss_fn(o)(got_pred, labels)
    handle.remove()
    torch.testing.assert_close(got_pred, preds[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want)
    return layers


@pytest.mark.parametrize(("name", "shape"), [("kandinsky5", (2, 4, 2, 4, 6)), ("kandinsky5-image", (2, 4, 4, 6))])
def test_kandinsky5_layers_equal_forward_and_need_one_prompt_length(name, shape):
    """Kandinsky 5 (video, and Image Lite on one frame): the layers (text stack in the embedding) predict as
    the transformer does and pipeline_inputs + the pipeline loss equal family.loss; prompts of two lengths
    are refused."""
    from diffpipe.config import ObjectiveConfig

    family = get_family(ModelConfig(family=name))
    den = _with_lora(family)
    latents = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    enc = family.load_text_encoders()
    text = family.encode_text(enc, ["a red circle", "a red square"])
    assert text["prompt_embeds_mask"].sum(1).unique().numel() == 1  # one prompt length
    layers = _layers_reproduce_the_loss(family, den, latents, text, ObjectiveConfig())
    assert len(layers) == len(den.visual_transformer_blocks) + 2
    two = family.encode_text(enc, ["a red circle", "a blue square moving left to right"])
    with pytest.raises(ValueError, match=rf"{name} with train.pipeline_stages > 1: .*train.batch_size: 1"):
        family.pipeline_inputs(latents, two, torch.Generator().manual_seed(0))


def test_cogvideox_layers_with_sincos_positions():
    """CogVideoX-2b-style models (sin-cos positions, no rotary embedding) through the same layers."""
    from diffusers import CogVideoXTransformer3DModel

    from diffpipe.families.cogvideox.flavors import TINY_TRANSFORMER

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

    from diffpipe.families.cosmos2.flavors import TINY_TRANSFORMER

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


# Per family: latent channels and an objective with non-default options (timestep sampling,
# shift, limits, weighting), so pipeline_inputs must honour each option as loss does.
PIPELINE_INPUT_CASES = {
    "sdxl": (4, {"min_snr_gamma": 5.0, "offset_noise": 0.1, "timestep_sampling": "logit_normal"}),
    "sd3": (4, {"weighting_scheme": "cosmap"}),
    "chroma": (1, {"timestep_sampling": "uniform", "min_timestep": 0.1, "max_timestep": 0.9}),
    "qwenimage": (4, {"shift": 2.0}),
    "hidream": (4, {"logit_mean": 0.5}),
    "cogview4": (4, {}),
    "cosmos2": (16, {"shift": 3.0}),
    "lumina2": (4, {"shift": 2.0, "loss": "huber"}),
    "zimage": (4, {"shift": 2.0}),
    "flux2-klein": (16, {"timestep_sampling": "uniform"}),
    "flux2": (16, {"shift": 2.0}),
    "ernie-image": (16, {"shift": 2.0}),
    "krea2": (4, {"timestep_sampling": "uniform"}),
    "ideogram4": (16, {"shift": 2.0}),
}


@pytest.mark.parametrize("name", list(PIPELINE_INPUT_CASES))
def test_image_family_pipeline_inputs_reproduce_the_loss(name):
    """Image families: the layers' prediction equals the denoiser's, and pipeline_inputs + the pipeline
    loss equal family.loss from the same generator state (real text embeddings, non-square latents);
    between layers every float tensor can carry a gradient, as DeepSpeed's backward needs."""
    from diffpipe.config import ObjectiveConfig
    from diffpipe.training.pipeline import pipeline_loss_fn

    family = get_family(ModelConfig(family=name))
    den = _with_lora(family)
    if name == "hidream":
        den.train()  # train mode outputs padded patches, which loss unpatchifies: the layers give the image
    channels, options = PIPELINE_INPUT_CASES[name]
    latents = torch.randn(2, channels, 1, 8, 12, generator=torch.Generator().manual_seed(0))
    text = family.encode_text(family.load_text_encoders(), ["a red circle", "a blue square on the left"])
    o = ObjectiveConfig(**options)
    # SDXL's size conditioning of planned crops (original size, crop corner), as the batches carry it.
    aux = {"sizes": {"original_size": torch.tensor([[48, 40], [64, 96]]),
                     "crop_top_left": torch.tensor([[8, 0], [0, 16]])}} if name == "sdxl" else {}
    preds = []
    handle = den.register_forward_hook(lambda m, a, out: preds.append(_prediction(out)))
    with torch.no_grad():
        want = family.loss(den, latents, text, torch.Generator().manual_seed(3), objective=o, **aux).mean()
        inputs, labels = family.pipeline_inputs(latents, text, torch.Generator().manual_seed(3), o, **aux)
        layers = family.pipeline_layers(den)
        got_pred = run_layers(layers, inputs)
        got = pipeline_loss_fn(o)(got_pred, labels)
    handle.remove()
    assert labels[0].shape == got_pred.shape and labels[1].shape == (2,)
    want_pred = preds[0] if preds[0].shape == got_pred.shape else None
    if name == "hidream":
        from diffpipe.families.hidream.family import unpatchify

        want_pred = unpatchify(preds[0], got_pred.shape, den.config.patch_size)
    if name == "ideogram4":  # the forward returns the whole text + image sequence; the image tokens are last
        want_pred = preds[0][:, -got_pred.shape[1]:]
    torch.testing.assert_close(got_pred, want_pred, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    _check_stage_boundaries(name, layers, inputs, labels, pipeline_loss_fn(o))


def _check_stage_boundaries(name, layers, inputs, labels, loss_fn):
    """What DeepSpeed's pipeline engine needs at a stage boundary after any layer (as the engine
    wraps the layers there).

    The sending stage (its first-stage inputs carry no grad) calls ``backward`` on every float
    tensor it sent, so each needs a graph or ``requires_grad``; the receiving stage sends back a
    gradient for every float tensor it received; complex tensors do not cross (NCCL sends none), and
    ``send`` takes contiguous tensors only.
    """
    from diffpipe.training.pipeline import stage_edges

    for k in range(1, len(layers)):
        staged = stage_edges(layers, [0, k, len(layers)])
        x = tuple(t.clone() for t in inputs)
        for layer in staged[:k]:
            x = layer(x)
        bad = [j for j, t in enumerate(x)
               if (t.is_floating_point() and not t.requires_grad) or t.is_complex() or not t.is_contiguous()]
        assert not bad, f"{name}: outputs {bad} of layer {k - 1} cannot cross a pipeline stage"
        received = tuple(t.detach().clone().requires_grad_(t.is_floating_point()) for t in x)
        y = tuple(t.clone() for t in received)
        for layer in staged[k:]:
            y = layer(y)
        loss_fn(y, labels).backward()
        no_grad = [j for j, t in enumerate(received) if t.is_floating_point() and t.grad is None]
        assert not no_grad, f"{name}: inputs {no_grad} of layer {k} get no gradient to send back"


def test_cogview4_pipeline_needs_one_prompt_length_per_micro_batch():
    """CogView4's loss runs each prompt length as its own forward; a pipeline micro-batch is one tensor."""
    family = get_family(ModelConfig(family="cogview4"))
    mask = torch.zeros(2, 16)
    mask[0, 6:], mask[1, 2:] = 1, 1  # 10 and 14 tokens (left-padded)
    text = {"prompt_embeds": torch.randn(2, 16, 32), "prompt_embeds_mask": mask}
    with pytest.raises(ValueError, match=r"\[10, 14\] tokens.*train.batch_size: 1"):
        family.pipeline_inputs(torch.randn(2, 4, 1, 8, 8), text, torch.Generator().manual_seed(0))
    mask[1, :6] = 0  # both 10 tokens: the prompts are cut to them
    inputs, _ = family.pipeline_inputs(torch.randn(2, 4, 1, 8, 8), text, torch.Generator().manual_seed(0))
    torch.testing.assert_close(inputs[2], text["prompt_embeds"][:, 6:])


@pytest.mark.parametrize("name", ["sd", "flux"])
def test_every_stage_boundary_meets_the_engine(name):
    """Splits anywhere, the output layer alone on the last stage included (it leaves the text unused)."""
    from diffpipe.config import ObjectiveConfig
    from diffpipe.training.pipeline import pipeline_loss_fn

    family = get_family(ModelConfig(family=name))
    den = _with_lora(family)
    ch, seq = (4, 77) if name == "sd" else (1, 32)
    latents = torch.randn(2, ch, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    text = {"prompt_embeds": torch.randn(2, seq, 32), "pooled_prompt_embeds": torch.randn(2, 32)}
    inputs, labels = family.pipeline_inputs(latents, text, torch.Generator().manual_seed(3))
    o = ObjectiveConfig()
    _check_stage_boundaries(name, family.pipeline_layers(den), inputs, labels, pipeline_loss_fn(o))


@pytest.mark.parametrize("variant", ["t2v", "i2v"])
def test_ltx2_layers_cross_stage_boundaries(variant):
    """LTX-2's tuple (the audio placeholder's states, an absent LTX-2.3 prompt modulation as an empty
    tensor) crosses a stage boundary after any layer; under ``i2v`` (a per-token timestep, the clip's for
    the audio stream) the layers' prediction equals the loss's forward."""
    from diffpipe.config import ObjectiveConfig
    from diffpipe.training.pipeline import pipeline_loss_fn

    family = get_family(ModelConfig(family="ltx2", variant=variant))
    den = _with_lora(family)
    latents = torch.randn(2, den.config.in_channels, 2, 4, 6, generator=torch.Generator().manual_seed(0))
    text = family.encode_text(family.load_text_encoders(), ["a red circle", "a blue square"])
    control = {"control": latents[:, :, :1] + 0.5} if variant == "i2v" else {}
    inputs, labels = family.pipeline_inputs(latents, text, torch.Generator().manual_seed(3), **control)
    layers = family.pipeline_layers(den)
    with torch.no_grad():
        prepared = family.prepare(latents, text, torch.Generator().manual_seed(3), objective=ObjectiveConfig(),
                                  **control)
        torch.testing.assert_close(run_layers(layers, inputs), family.predict(den, prepared), rtol=1e-5, atol=1e-5)
    _check_stage_boundaries("ltx2", layers, inputs, labels, pipeline_loss_fn(ObjectiveConfig()))


def test_helios_layers_cross_stage_boundaries():
    """Helios' tuple (the history's rotary positions and timestep modulation before the chunk's, the chunk's
    token count) crosses a stage boundary after any layer."""
    from diffpipe.config import ObjectiveConfig
    from diffpipe.training.pipeline import pipeline_loss_fn

    family = get_family(ModelConfig(family="helios"))
    den = _with_lora(family)
    latents = torch.randn(2, den.config.in_channels, 2, 4, 6, generator=torch.Generator().manual_seed(0))
    text = family.encode_text(family.load_text_encoders(), ["a red circle", "a blue square"])
    inputs, labels = family.pipeline_inputs(latents, text, torch.Generator().manual_seed(3))
    _check_stage_boundaries("helios", family.pipeline_layers(den), inputs, labels, pipeline_loss_fn(ObjectiveConfig()))
