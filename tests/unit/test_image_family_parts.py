"""The newer image families' pure parts and text encoding, against the stock pipelines' own code."""

from __future__ import annotations

import math

import pytest
import torch

from diffpipe.config import ModelConfig, ObjectiveConfig
from diffpipe.data.cache.buckets import crop_top_left
from diffpipe.families import get_family
from diffpipe.families.sdxl.family import time_ids
from diffpipe.models.components import TextBundle
from diffpipe.models.objectives import sample_mode, weighting_scheme_weights

CAPTIONS = ["a red circle", "x"]


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFPIPE_CACHE", str(tmp_path))


def test_sdxl_time_ids_match_the_pipeline():
    family = get_family(ModelConfig(family="sdxl"))
    pipe = family.load_pipeline()
    theirs = pipe._get_add_time_ids((96, 80), (8, 0), (64, 48), torch.float32, text_encoder_projection_dim=32)
    ours = time_ids(torch.tensor([[96, 80]]), torch.tensor([[8, 0]]), torch.tensor([[64, 48]]))
    assert torch.equal(ours, theirs)


def test_sdxl_crop_conditioning():
    # 200x100 (h x w) into a 64x64 bucket: resized to 128x64, centre crop starts 32 rows down.
    assert crop_top_left((200, 100), (64, 64), (0.5, 0.5)) == (32, 0)
    assert crop_top_left((200, 100), (64, 64), (0.0, 0.5)) == (0, 0)
    assert crop_top_left((64, 64), (64, 64), (0.5, 0.5)) == (0, 0)


def test_sdxl_loss_reads_sizes():
    family = get_family(ModelConfig(family="sdxl"))
    unet = family.load_denoiser()
    latents = torch.randn(2, 4, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    text = {"prompt_embeds": torch.randn(2, 77, 64), "pooled_prompt_embeds": torch.randn(2, 32)}
    args = dict(t=torch.tensor([0.2, 0.6]), noise=torch.randn(2, 4, 16, 16))
    with torch.no_grad():
        plain = family.loss(unet, latents, text, torch.Generator(), **args)
        same = family.loss(unet, latents, text, torch.Generator(), sizes={
            "original_size": torch.tensor([[32, 32]] * 2), "crop_top_left": torch.zeros(2, 2)}, **args)
        other = family.loss(unet, latents, text, torch.Generator(), sizes={
            "original_size": torch.tensor([[80, 32]] * 2), "crop_top_left": torch.tensor([[24, 0]] * 2)}, **args)
    assert torch.equal(plain, same) and not torch.equal(plain, other)


def test_sd3_densities_and_weights():
    g = torch.Generator().manual_seed(0)
    draw = sample_mode(1000, g)
    assert draw.min() >= 0 and draw.max() <= 1
    sigma = torch.tensor([0.25, 0.5])
    assert torch.allclose(weighting_scheme_weights("sigma_sqrt", sigma), torch.tensor([16.0, 4.0]))
    assert torch.allclose(weighting_scheme_weights("cosmap", sigma), 2 / (math.pi * (1 - 2 * sigma + 2 * sigma**2)))
    assert weighting_scheme_weights(None, sigma) is None


def _pipeline_text(name, family, pipe):
    if name == "sdxl":
        pe, _, pooled, _ = pipe.encode_prompt(CAPTIONS, do_classifier_free_guidance=False)
        return {"prompt_embeds": pe, "pooled_prompt_embeds": pooled}
    if name == "sd3":
        pe, _, pooled, _ = pipe.encode_prompt(CAPTIONS, None, None, do_classifier_free_guidance=False,
                                              max_sequence_length=family.max_sequence_length)
        return {"prompt_embeds": pe, "pooled_prompt_embeds": pooled}
    if name == "chroma":
        pe, mask = pipe._get_t5_prompt_embeds(CAPTIONS, max_sequence_length=family.max_sequence_length)
        return {"prompt_embeds": pe, "prompt_attention_mask": mask}
    if name == "lumina2":
        pe, mask, *_ = pipe.encode_prompt(CAPTIONS, do_classifier_free_guidance=False,
                                          max_sequence_length=family.max_sequence_length)
        return {"prompt_embeds": pe, "prompt_attention_mask": mask}
    if name == "hidream":
        t5, _, llama, _, pooled, _ = pipe.encode_prompt(prompt=CAPTIONS, do_classifier_free_guidance=False,
                                                        max_sequence_length=family.max_sequence_length)
        return {"prompt_embeds_t5": t5, "prompt_embeds_llama3": llama.transpose(0, 1), "pooled_prompt_embeds": pooled}
    if name == "krea2":  # the fixed-length template block, twelve layers' states per token
        pe, mask = pipe.encode_prompt(CAPTIONS, max_sequence_length=family.max_sequence_length)
        return {"prompt_embeds": pe, "prompt_embeds_mask": mask}
    if name in ("flux2-klein", "flux2"):  # the chat template, padded to the length, three layers' states stacked
        pe, _ = pipe.encode_prompt(CAPTIONS, max_sequence_length=family.max_sequence_length)
        return {"prompt_embeds": pe}
    pe, mask = pipe._get_qwen_prompt_embeds(CAPTIONS)
    return {"prompt_embeds": pe, "prompt_embeds_mask": mask}


@pytest.mark.parametrize("name", ["sdxl", "sd3", "chroma", "lumina2", "qwenimage", "hidream", "flux2-klein", "flux2",
                                  "krea2"])
def test_cached_text_equals_the_pipeline_encoding(name):
    family = get_family(ModelConfig(family=name))
    ours = family.encode_text(family.load_text_encoders(), CAPTIONS)
    with torch.no_grad():
        theirs = _pipeline_text(name, family, family.load_pipeline())
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        n = value.shape[1] if value.ndim > 1 else None
        mine = ours[key][:, :n] if n else ours[key]  # Qwen: the cache pads to a fixed length
        torch.testing.assert_close(mine, value.float(), rtol=1e-5, atol=1e-5)
        if n and ours[key].shape[1] > n:
            assert not ours[key][:, n:].any()


def test_flux2_klein_latents_are_the_pipelines_and_its_decode_inverts_them():
    family = get_family(ModelConfig(family="flux2-klein"))
    pipe = family.load_pipeline()
    vae = pipe.vae
    assert vae.bn.running_mean.abs().max() > 0.1 and (vae.bn.running_var - 1).abs().max() > 0.1  # exercised
    pixels = torch.rand(2, 3, 1, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    ours = family.encode_pixels(vae, pixels)
    with torch.no_grad():
        theirs = pipe._encode_vae_image(pixels[:, :, 0], None)  # patchified, batch-norm normalised
    assert ours.shape == (2, 16, 1, 8, 12) and torch.equal(ours[:, :, 0], theirs)
    # The pipeline's decode path (as in its __call__): un-normalise, unpatchify; equals the raw latent mode.
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    back = pipe._unpatchify_latents(ours[:, :, 0] * std + mean)
    with torch.no_grad():
        raw = vae.encode(pixels[:, :, 0]).latent_dist.mode()
    torch.testing.assert_close(back, raw, rtol=1e-5, atol=1e-5)
    # The loss's positions are the pipeline's: text (0, 0, 0, l) and image (0, h, w, 0) ids.
    text = family.encode_text(family.load_text_encoders(), CAPTIONS)
    p = family.prepare(ours, text, torch.Generator().manual_seed(0), objective=ObjectiveConfig())
    _, ids = pipe.prepare_latents(2, 4, 32, 48, torch.float32, "cpu", torch.Generator().manual_seed(0))
    assert torch.equal(p.inputs["img_ids"], ids) and p.inputs["hidden_states"].shape == (2, 96, 16)
    assert torch.equal(p.inputs["txt_ids"][0, :, 3], torch.arange(text["prompt_embeds"].shape[1]))


def test_ernie_image_text_and_latents_are_the_pipelines():
    family = get_family(ModelConfig(family="ernie-image"))
    pipe = family.load_pipeline()
    ours = family.encode_text(family.load_text_encoders(), CAPTIONS)
    with torch.no_grad():
        theirs = pipe.encode_prompt(CAPTIONS, "cpu")  # one tensor per caption, at its own length
    for i, hidden in enumerate(theirs):
        n = hidden.shape[0]
        assert ours["prompt_embeds_mask"][i].sum() == n and not ours["prompt_embeds"][i, n:].any()
        torch.testing.assert_close(ours["prompt_embeds"][i, :n], hidden.float(), rtol=1e-5, atol=1e-5)
    pixels = torch.rand(2, 3, 1, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = family.encode_pixels(pipe.vae, pixels)
    # The pipeline's decode (batch-norm statistics with its epsilon, unpatchify) gives back the latent mode.
    vae = pipe.vae
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + 1e-5)
    back = pipe._unpatchify_latents(latents[:, :, 0] * std + vae.bn.running_mean.view(1, -1, 1, 1))
    with torch.no_grad():
        raw = vae.encode(pixels[:, :, 0]).latent_dist.mode()
    assert vae.bn.running_mean.abs().max() > 0.1
    torch.testing.assert_close(back, raw, rtol=1e-5, atol=1e-5)
    # The loss's transformer call is the pipeline's: padded captions cut to the longest, with their lengths.
    p = family.prepare(latents, ours, torch.Generator().manual_seed(0), objective=ObjectiveConfig())
    text, lens = pipe._pad_text(list(theirs), "cpu", torch.float32, pipe.transformer.config.text_in_dim)
    torch.testing.assert_close(p.inputs["text_bth"], text, rtol=1e-5, atol=1e-5)
    assert torch.equal(p.inputs["text_lens"], lens)


def test_krea2_inputs_are_the_pipelines():
    """Packed tokens as ``prepare_latents`` packs them, the pipeline's positions, and the token count that
    decides truncation (prefix and caption, less the 34 cut tokens, plus the 5 counted for the suffix)."""
    family = get_family(ModelConfig(family="krea2"))
    pipe = family.load_pipeline()
    latents = torch.randn(2, 4, 1, 8, 12, generator=torch.Generator().manual_seed(0))
    text = family.encode_text(family.load_text_encoders(), CAPTIONS)
    p = family.prepare(latents, text, torch.Generator().manual_seed(0), objective=ObjectiveConfig(),
                       t=torch.tensor([1.0 - 1e-6, 0.5]), noise=latents[:, :, 0])
    packed = pipe._pack_latents(latents[:, :, 0], 2, 4, 8, 12)
    torch.testing.assert_close(p.inputs["hidden_states"][0], packed[0], rtol=1e-4, atol=1e-4)  # sigma ~ 1: noise
    assert torch.equal(p.inputs["position_ids"], pipe.prepare_position_ids(text["prompt_embeds"].shape[1], 4, 6, "cpu"))
    tok = family.load_tokenizers().tokenizer
    limit = family.max_sequence_length + 34 - 5  # the tokens the pipeline keeps of prefix + caption
    long = "word " * 400
    (count,) = family.count_tokens(family.load_tokenizers(), [long])["qwen3-vl"]
    assert count > family.max_sequence_length
    assert len(tok(pipe.prompt_template_encode_prefix + long).input_ids) > limit


def test_ideogram4_text_tokens_and_sequence_are_the_pipelines():
    """Cached text equals ``encode_prompt``; the stock pipeline, run on our cached tokens with both
    transformers replaced by a recorder returning zeros (so its steps leave the latents unchanged), hands
    its decode the raw latent mode, and its transformer call has our loss's packed sequence, positions,
    segments and roles."""
    family = get_family(ModelConfig(family="ideogram4"))
    pipe = family.load_pipeline()
    assert pipe.unconditional_transformer is not None and pipe.vae.bn.running_mean.abs().max() > 0.1
    captions = ["a red circle", "two blue squares on a green field"]
    ours = family.encode_text(family.load_text_encoders(), captions)
    with torch.no_grad():
        theirs = pipe.encode_prompt(captions, 0, 0, family.max_sequence_length, "cpu")
    torch.testing.assert_close(ours["prompt_embeds"], theirs[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(ours["prompt_embeds_mask"].bool(), theirs[3] == 3)  # LLM_TOKEN_INDICATOR
    lengths = ours["prompt_embeds_mask"].sum(1).long()
    assert lengths[0] != lengths[1]

    pixels = torch.rand(2, 3, 1, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = family.encode_pixels(pipe.vae, pixels)
    assert latents.shape == (2, 16, 1, 8, 12)
    calls, decoded = [], []

    def recorder(**kwargs):
        calls.append(kwargs)
        return (torch.zeros_like(kwargs["hidden_states"]),)

    pipe.transformer.forward = recorder
    pipe.unconditional_transformer.forward = recorder
    decode = pipe.vae.decode
    pipe.vae.decode = lambda z, **kw: (decoded.append(z), decode(z, **kw))[1]
    tokens = latents[:, :, 0].flatten(2).transpose(1, 2)  # [B, h*w, 4C], row-major
    pipe(captions, height=32, width=48, num_inference_steps=1, guidance_scale=2.0, guidance_schedule=None,
         max_sequence_length=int(lengths.max()), latents=tokens, output_type="pt")
    with torch.no_grad():
        raw = pipe.vae.encode(pixels[:, :, 0]).latent_dist.mode()
    torch.testing.assert_close(decoded[0], raw, rtol=1e-5, atol=1e-5)

    # Noise equal to x0 makes the noisy tokens x0 at any sigma: the sequences compare exactly.
    p = family.prepare(latents, ours, torch.Generator().manual_seed(0), objective=ObjectiveConfig(),
                       noise=latents[:, :, 0])
    conditional = calls[0]
    for key in ("position_ids", "segment_ids", "indicator"):
        assert torch.equal(p.inputs[key], conditional[key]), key
    for key in ("hidden_states", "encoder_hidden_states"):
        torch.testing.assert_close(p.inputs[key], conditional[key], rtol=1e-5, atol=1e-5)
    assert conditional["hidden_states"].shape == (2, int(lengths.max()) + 96, 16)
    assert calls[1]["hidden_states"].shape == (2, 96, 16)  # the unconditional branch: image tokens only
    assert family.shift_for(latents[:, :, 0]) == pytest.approx(math.sqrt(32 * 48) / 512)


def test_hidream_loss_is_the_same_in_train_and_eval_mode():
    # In train mode the transformer returns patches (padded to max_seq when not square); the loss unpatchifies.
    family = get_family(ModelConfig(family="hidream"))
    tr = family.load_denoiser()
    text = {"prompt_embeds_t5": torch.randn(2, 32, 32), "prompt_embeds_llama3": torch.randn(2, 2, 32, 32),
            "pooled_prompt_embeds": torch.randn(2, 64)}
    for h, w in [(16, 16), (16, 24)]:
        latents, noise, t = torch.randn(2, 4, 1, h, w), torch.randn(2, 4, h, w), torch.tensor([0.3, 0.6])
        with torch.no_grad():
            train = family.loss(tr.train(), latents, text, torch.Generator(), t=t, noise=noise)
            evaluated = family.loss(tr.eval(), latents, text, torch.Generator(), t=t, noise=noise)
        torch.testing.assert_close(train, evaluated)


@pytest.mark.parametrize("name", ["flux-kontext", "qwenimage-edit"])
def test_edit_family_without_control_latents_names_the_dataset_keys(name):
    family = get_family(ModelConfig(family=name))
    with pytest.raises(ValueError, match=rf"'{name}' needs control latents .*control_path or control_column"):
        family.loss(None, torch.zeros(1, 4, 1, 8, 8), {}, torch.Generator())


def test_flux2_dev_loss_inputs_are_the_pipelines_first_call():
    """FLUX.2 [dev]: the stock pipeline's first transformer call, at the guidance the family trains with,
    gets the loss's text, positions and guidance, and a noisy input of the loss's shape."""
    family = get_family(ModelConfig(family="flux2"))
    pipe = family.load_pipeline()
    calls = []
    handle = pipe.transformer.register_forward_pre_hook(lambda m, a, kw: calls.append(kw), with_kwargs=True)
    try:
        with torch.no_grad():
            pipe(prompt=CAPTIONS, height=32, width=48, num_inference_steps=1, guidance_scale=family.train_guidance,
                 max_sequence_length=family.max_sequence_length, output_type="latent",
                 generator=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    text = family.encode_text(family.load_text_encoders(), CAPTIONS)
    p = family.prepare(torch.randn(2, 16, 1, 8, 12), text, torch.Generator().manual_seed(0), objective=ObjectiveConfig())
    assert list(p.inputs) == ["hidden_states", "timestep", "guidance", "encoder_hidden_states", "txt_ids", "img_ids"]
    for key in ("guidance", "encoder_hidden_states", "txt_ids", "img_ids"):
        torch.testing.assert_close(p.inputs[key], calls[0][key], rtol=1e-5, atol=1e-5)
    assert p.inputs["hidden_states"].shape == calls[0]["hidden_states"].shape


def test_flux2_dev_tokenizer_takes_the_processors_chat_template(tmp_path):
    """A FLUX.2 [dev] folder's ``tokenizer`` is a PixtralProcessor's: where the tokenizer files carry no chat
    template, the processor's ``chat_template.json`` is read; with neither, the error names the folder."""
    import json

    from diffpipe.families.flux2.family import TINY_CHAT_TEMPLATE, MistralChatTokenizer, _tiny_tokenizer

    tok = _tiny_tokenizer()
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "tokenizer")
    with pytest.raises(ValueError, match=r"tokenizer: the FLUX.2 \[dev\] tokenizer has no chat template"):
        MistralChatTokenizer.from_pretrained(tmp_path, subfolder="tokenizer")
    (tmp_path / "tokenizer" / "chat_template.json").write_text(json.dumps({"chat_template": TINY_CHAT_TEMPLATE}))
    loaded = MistralChatTokenizer.from_pretrained(tmp_path, subfolder="tokenizer")
    assert loaded.chat_template == TINY_CHAT_TEMPLATE
    family = get_family(ModelConfig(family="flux2"))
    assert family.count_tokens(TextBundle({"tokenizer": loaded}), CAPTIONS) == family.count_tokens(
        family.load_tokenizers(), CAPTIONS)
