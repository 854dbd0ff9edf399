"""The text-to-video families beyond Wan on their tiny flavors, through every real stage.

One parametrized module with shared set-up, as ``test_image_families.py``:
validate → plan → cache latents and text → 2 DeepSpeed steps → diffusers
export → sample (the family's stock pipeline renders MP4 clips), run
in-process through the real Typer app. Then the exported file is loaded into
the stock pipeline with ``load_lora_weights``: the transformer's output
changes and equals the trained adapter's (allclose), measured on a cached
batch of clips through the family's own loss.

The clips are the demo clips (``config/demo_video_data``: 9 frames at 16 fps,
48x32). CogVideoX's 8 fps leaves them 4 frames (one 4k+1 frame), so its part
writes the same moving shapes at 8 fps instead. Cosmos-Predict2 Video2World
continues a clip from its first frames: its samples start from
``sample.images``, and its conditioning is checked against the stock
pipeline's construction.

The run's losses and exported LoRA are also compared with the golden values in
``tests/assets/golden_losses.json``; ``DIFFPIPE_UPDATE_GOLDEN=1`` rewrites them
deliberately (see ``tests/golden.py``).
"""

from __future__ import annotations

import shutil

import av
import peft
import pytest
import torch
import yaml
from family_tables import missing_rows, row, video_families
from PIL import Image
from stage_cli import rendezvous, run_stages

from diffpipe.cache_decode import decode_item
from diffpipe.config import ModelConfig, ObjectiveConfig, SampleConfig, load_config
from diffpipe.data.cache.plan import read_spec
from diffpipe.data.cache.reader import CachedDataset
from diffpipe.data.dataset.demo_video import write_demo_clips
from diffpipe.families import get_family
from diffpipe.families.published import PUBLISHED
from diffpipe.families.wan import i2v as wan_i2v
from diffpipe.paths import REPO_ROOT, RunPaths
from diffpipe.training.adapter import apply_adapter

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning")]  # Mochi's rope

# family -> (frame bucket, latent (F, h, w), sample frames): each family's frame rule at its frame rate.
SPECS = {
    "ltxvideo": (9, (2, 3, 5), 9),  # 25 fps: 14 frames available -> 8k+1 = 9; sides multiples of 8: 40x24
    "cogvideox": (9, (3, 4, 6), 9),  # 8 fps clips of 9 frames; an odd latent count decodes back to 9 frames
    "hunyuanvideo": (5, (2, 4, 6), 5),  # 24 fps: 13 available, bucket 5 (4k+1)
    "hunyuanvideo15": (5, (2, 3, 5), 5),  # 24 fps, 4k+1 frames; sides multiples of 8: 40x24
    "mochi": (7, (2, 4, 6), 7),  # 30 fps: 16 available, bucket 7 (6k+1)
    "cosmos2-video": (9, (3, 4, 6), 9),  # 16 fps: the 9 demo frames (4k+1)
    "skyreels-v2": (5, (2, 4, 6), 5),  # 24 fps, Wan's 4k+1 frames
    "kandinsky5": (5, (2, 4, 6), 5),  # 24 fps, HunyuanVideo's VAE: 4k+1 frames
    "helios": (5, (2, 4, 6), 33),  # 24 fps, Wan's 4k+1 frames; samples are whole 33-frame chunks
    "ltx2": (9, (2, 3, 5), 9),  # 24 fps: 13 frames available -> 8k+1 = 9; sides multiples of 8: 40x24
}


@pytest.fixture(scope="module")
def demo_clips(tmp_path_factory):
    root = tmp_path_factory.mktemp("clips")
    shutil.copytree(REPO_ROOT / "config" / "demo_video_data", root / "demo")
    write_demo_clips(root / "eight_fps", n=2, frames=9, width=48, height=32, fps=8)
    return root


_SPECS_ROW = ("SPECS in tests/stages/test_video_families.py",
              "(frame bucket, latent (F, h, w), sample frames) for its frame rate and frame rule")


def _spec(name: str) -> tuple:
    return row(SPECS, name, *_SPECS_ROW)


def test_every_video_family_has_a_row():
    """Every registered video family without a module of its own runs here: each needs its SPECS row."""
    assert not (missing := missing_rows(video_families(), SPECS, *_SPECS_ROW)), "\n".join(missing)


@pytest.fixture(scope="module", params=video_families())
def run(request, demo_clips, tmp_path_factory):
    name = request.param
    bucket, _, frames = _spec(name)
    monkeypatch = rendezvous()
    root = tmp_path_factory.mktemp(name)
    data = demo_clips / ("eight_fps" if name == "cogvideox" else "demo")
    cfg = {
        "output_dir": "run",
        "model": {"family": name, "flavor": "tiny"},
        "datasets": [{"name": "clips", "path": str(data), "resolution": 32, "frame_buckets": [bucket]}],
        "cache": {"shards": 1, "workers": 0},
        "train": {"max_steps": 2, "batch_size": 2, "lr": 0.01, "save_every_epochs": 0, "eval": {"quantiles": []}},
        "export": {"formats": ["diffusers", "peft"]},
        "sample": {
            "prompts": ["a red circle moving left to right"],
            "steps": 2,
            "width": 32,
            "height": 32,
            "frames": frames,
        },
    }
    if name == "cosmos2-video":  # Video2World continues an image
        Image.new("RGB", (48, 32), (200, 30, 30)).save(root / "start.png")
        cfg["sample"]["images"] = [str(root / "start.png")]
    config = root / f"{name}.yaml"
    config.write_text(yaml.safe_dump(cfg))
    c = str(config)
    try:
        paths = RunPaths(root / "run")
        run_stages(c, cwd=root, monkeypatch=monkeypatch)
    finally:
        monkeypatch.undo()
    return load_config(config), paths


def test_clips_take_the_family_frame_rule(run):
    cfg, p = run
    bucket, latent_shape, _ = _spec(cfg.model.family)
    items = read_spec(p.latent_spec("s0000"))["items"]
    assert items and all(it["bucket"][0] == bucket and len(it["frames"]) == bucket for it in items)
    ds = CachedDataset.from_run(p)
    assert {tuple(ds.collate([i])["latents"].shape[2:]) for i in range(len(ds))} == {latent_shape}


def test_stages_write_their_outputs(run):
    cfg, p = run
    for f in [p.manifest, p.adapter_file, p.metrics, p.export_diffusers, p.sample_grid]:
        assert f.exists(), f
    assert len(p.metrics.read_text().splitlines()) == 2
    with av.open(str(p.samples_dir / "sample-00.mp4")) as container:
        clip = list(container.decode(video=0))
    assert len(clip) == _spec(cfg.model.family)[2] and (clip[0].width, clip[0].height) == (32, 32)


def test_golden_losses_and_lora(run, golden):
    """The 2 losses and the exported LoRA equal the stored golden values (tests/golden.py)."""
    cfg, p = run
    golden(cfg.model.family, "test_video_families::run", p)


def _denoiser_output(family, denoiser, batch, **aux) -> torch.Tensor:
    """The denoiser's raw output on a cached batch, fixed t and noise, through the family's loss (``aux``:
    its extra inputs, the control latents); the outputs of a loss that runs several forwards, concatenated."""
    out = []
    handle = denoiser.register_forward_hook(lambda m, a, o: out.append(o[0] if isinstance(o, tuple) else o.sample))
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            family.loss(denoiser, batch["latents"], batch["text"], torch.Generator(), t=torch.tensor([0.3, 0.7]),
                        noise=noise, **aux)
    finally:
        handle.remove()
    return torch.cat(out)


def test_lora_loads_in_stock_pipeline_and_matches_training(run):
    cfg, p = run
    family = get_family(cfg.model)
    batch = CachedDataset.from_run(p).collate([0, 1])
    pipe = family.load_pipeline()
    assert isinstance(pipe, family.pipeline_class)
    base = _denoiser_output(family, pipe.transformer, batch)
    family.load_lora(pipe, p.export_diffusers)
    loaded = _denoiser_output(family, pipe.transformer, batch)
    expected = _denoiser_output(family, apply_adapter(family.load_denoiser(), p.adapter_dir), batch)
    assert (loaded - base).abs().max() > 1e-5, "the LoRA does not change the output"
    torch.testing.assert_close(loaded, expected, rtol=1e-5, atol=1e-5)
    peft_denoiser = family.load_denoiser()
    peft.PeftModel.from_pretrained(peft_denoiser, str(p.export_file("peft")))  # injects into peft_denoiser
    torch.testing.assert_close(_denoiser_output(family, peft_denoiser, batch), expected, rtol=1e-5, atol=1e-5)


def test_text_cache_equals_the_pipeline_prompt_embeds(run):
    cfg, _ = run
    family = get_family(cfg.model)
    captions = ["a red circle", "a blue square moving left to right"]
    enc = family.load_text_encoders()
    ours = family.encode_text(enc, captions)
    pipe = family.load_pipeline()
    with torch.no_grad():
        if family.name == "hunyuanvideo":
            # Our code measures the template's crop for its own tokenizer: the kept part starts at the prompt.
            tpl = enc.prompt_template
            ids = enc.tokenizer(tpl["template"].format(captions[0])).input_ids
            assert ids[tpl["crop_start"] : tpl["crop_start"] + 3] == enc.tokenizer(captions[0]).input_ids[1:4]
            embeds, pooled, mask = pipe.encode_prompt(
                captions, prompt_template=tpl, max_sequence_length=enc.max_sequence_length
            )
            theirs = {"prompt_embeds": embeds, "prompt_attention_mask": mask, "pooled_prompt_embeds": pooled}
        elif family.name == "hunyuanvideo15":  # Qwen2.5-VL's states after the template, ByT5's of quoted text
            embeds, mask, embeds_2, mask_2 = pipe.encode_prompt(captions, batch_size=2, dtype=torch.float32)
            theirs = {"prompt_embeds": embeds, "prompt_embeds_mask": mask, "prompt_embeds_2": embeds_2,
                      "prompt_embeds_mask_2": mask_2}
        elif family.name in ("skyreels-v2", "helios"):  # Wan's: zeros past each prompt's tokens, no mask
            embeds, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False,
                                           max_sequence_length=enc.max_sequence_length)
            theirs = {"prompt_embeds": embeds}
        elif family.name == "kandinsky5":  # each prompt alone, at its own length, left-aligned in our rows
            theirs = {k: torch.zeros_like(v) for k, v in ours.items()}
            for i, caption in enumerate(captions):
                qwen, clip, cu = pipe.encode_prompt([caption], max_sequence_length=enc.max_sequence_length,
                                                    dtype=torch.float32)
                n = qwen.shape[1]
                assert cu.tolist() == [0, n]
                theirs["prompt_embeds"][i, :n], theirs["prompt_embeds_mask"][i, :n] = qwen[0], 1.0
                theirs["pooled_prompt_embeds"][i] = clip[0]
            assert theirs["prompt_embeds_mask"].sum(1).unique().numel() == 2  # two lengths: one forward each
        elif family.name == "ltx2":  # Gemma's stacked states through the pipeline's connectors
            embeds, mask, _, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False,
                                                    max_sequence_length=enc.max_sequence_length)
            video_text, _, video_mask = pipe.connectors(embeds, mask, padding_side=pipe.tokenizer.padding_side)
            theirs = {"prompt_embeds": video_text, "prompt_attention_mask": video_mask}
        elif family.name in ("cogvideox", "cosmos2-video"):
            theirs = {
                "prompt_embeds": pipe._get_t5_prompt_embeds(captions, max_sequence_length=enc.max_sequence_length)
            }
        else:
            embeds, mask = pipe._get_t5_prompt_embeds(captions, max_sequence_length=enc.max_sequence_length)
            theirs = {"prompt_embeds": embeds, "prompt_attention_mask": mask}
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value.float(), rtol=1e-4, atol=1e-5)


def test_local_flavor_loads_the_saved_pipeline(run, tmp_path):
    cfg, _ = run
    family = get_family(cfg.model)
    family.load_pipeline().save_pretrained(tmp_path)
    local = get_family(ModelConfig(family=family.name, flavor="local", path=str(tmp_path)))
    assert local.vae_identity() == family.vae_identity()
    assert local.text_identity() == family.text_identity()
    assert (local.frame_rule, local.pixel_multiple, local.fps) == (family.frame_rule, family.pixel_multiple, family.fps)
    a, b = family.load_denoiser().state_dict(), local.load_denoiser().state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_loss_mask_weights_the_clip(run):
    cfg, p = run
    family = get_family(cfg.model)
    denoiser, batch = family.load_denoiser(), CachedDataset.from_run(p).collate([0, 1])
    latents = batch["latents"]
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(0))

    def loss(mask):
        with torch.no_grad():
            return family.loss(
                denoiser, latents, batch["text"], torch.Generator(), t=torch.tensor([0.3, 0.7]), noise=noise, mask=mask
            )

    ones = torch.ones(2, 1, *latents.shape[2:])
    left = torch.zeros_like(ones)
    left[..., :2] = 1
    torch.testing.assert_close(loss(ones), loss(None))
    assert not torch.allclose(loss(left), loss(None))


def _first_transformer_call(family, **call) -> dict:
    """The keyword arguments of the stock pipeline's first transformer call, unguided, for "a red circle"
    (the transformer replaced by a recorder returning zeros: a video, or a video and audio, output)."""
    pipe = family.load_pipeline()
    calls = []

    def recorder(**kwargs):
        calls.append(kwargs)
        zeros = [torch.zeros_like(kwargs[k]) for k in ("hidden_states", "audio_hidden_states") if k in kwargs]
        return tuple(zeros)

    pipe.transformer.forward = recorder
    pipe(prompt="a red circle", num_inference_steps=2, guidance_scale=1.0, output_type="latent",
         max_sequence_length=family.max_sequence_length, **call)
    return calls[0]


@pytest.mark.parametrize("run", ["helios"], indirect=True)
def test_helios_trains_the_first_chunk_as_the_pipeline_feeds_it(run):
    """Helios: the stock pipeline's first transformer call (recorded; the transformer returns zeros) has
    the history inputs the loss gives (zero latents, the same frame indices) and a timestep of the same
    shift; a 9-latent-frame clip is exactly its first chunk."""
    cfg, p = run
    family = get_family(cfg.model)
    first = _first_transformer_call(family, height=32, width=48, num_frames=33)
    assert first["hidden_states"].shape[2] == 9  # the chunk: 9 latent frames
    batch = CachedDataset.from_run(p).collate([0, 1])
    latents = torch.randn(2, 16, 9, 4, 6, generator=torch.Generator().manual_seed(0))
    sigma0 = first["timestep"][0] / 1000
    shift = family.chunk_shift(4, 6)
    t = sigma0 / (shift - (shift - 1) * sigma0)  # the fraction whose shifted level is the pipeline's first
    prepared = family.prepare(latents, batch["text"], torch.Generator(), objective=ObjectiveConfig(),
                              t=t.expand(2))
    ours = prepared.inputs
    assert set(ours) == set(first) - {"attention_kwargs", "return_dict"}
    for key, value in first.items():
        if key.startswith("indices_"):
            assert torch.equal(ours[key], value), key
        elif key.startswith("latents_history_"):
            assert ours[key].shape[1:] == value.shape[1:] and not ours[key].any() and not value.any(), key
    torch.testing.assert_close(ours["timestep"], first["timestep"].expand(2).float(), rtol=1e-5, atol=1e-3)
    assert shift > 1  # the tiny scheduler shifts dynamically, as Helios-Base's


#: LTX2Pipeline's other guidance terms off (each adds transformer calls), for a single conditional call.
LTX2_UNGUIDED = {"audio_guidance_scale": 1.0, "stg_scale": 0.0, "audio_stg_scale": 0.0, "modality_scale": 1.0,
                 "audio_modality_scale": 1.0}


@pytest.mark.parametrize("run", ["hunyuanvideo15"], indirect=True)
def test_hunyuanvideo15_trains_what_the_pipeline_feeds(run):
    """HunyuanVideo 1.5: the stock pipeline's first transformer call (hooked) gets the cached text of both
    encoders, zero condition latents and mask stacked after the noisy clip, zero image embeddings (its
    text-to-video switch), and the timestep of the loss at the same shift."""
    cfg, _ = run
    family = get_family(cfg.model)
    pipe = family.load_pipeline()
    calls = []
    pipe.transformer.register_forward_pre_hook(lambda m, a, kw: calls.append(kw), with_kwargs=True)
    with torch.no_grad():
        pipe(prompt="a red circle", height=24, width=40, num_frames=5, num_inference_steps=2, output_type="latent")
    first = calls[0]
    text = family.encode_text(family.load_text_encoders(), ["a red circle"])
    latents = torch.randn(1, 4, 2, 3, 5, generator=torch.Generator().manual_seed(0))
    sigma0 = first["timestep"][0] / 1000
    shift = family.shift_for(latents)
    t = sigma0 / (shift - (shift - 1) * sigma0)  # the fraction whose shifted level is the pipeline's first
    ours = family.prepare(latents, text, torch.Generator(), objective=ObjectiveConfig(), t=t.expand(1)).inputs
    assert set(ours) | {"image_embeds"} == {k for k, v in first.items() if isinstance(v, torch.Tensor)}
    assert ours["hidden_states"].shape == first["hidden_states"].shape == (1, 9, 2, 3, 5)
    assert not first["hidden_states"][:, 4:].any() and not ours["hidden_states"][:, 4:].any()
    embeds = family.image_embeds(pipe.transformer, ours["hidden_states"])  # what predict adds
    assert embeds.shape == first["image_embeds"].shape and not first["image_embeds"].any() and not embeds.any()
    for key in ("encoder_hidden_states", "encoder_attention_mask", "encoder_hidden_states_2",
                "encoder_attention_mask_2", "timestep"):
        torch.testing.assert_close(ours[key], first[key].float(), rtol=1e-5, atol=1e-3)
    assert shift > 1


@pytest.mark.parametrize("run", ["ltx2"], indirect=True)
def test_ltx2_trains_the_video_stream_as_the_pipeline_feeds_it(run):
    """LTX-2: the stock pipeline's first transformer call (recorded; the transformer returns zeros) gets
    the cached text, the same latent grid, frame rate and timestep for the same shift as the loss; the
    loss isolates the modalities, so its video prediction does not depend on the audio placeholder (and
    would with the cross-modal attention on)."""
    cfg, p = run
    family = get_family(cfg.model)
    first = _first_transformer_call(family, height=32, width=32, num_frames=9, **LTX2_UNGUIDED)
    text = family.encode_text(family.load_text_encoders(), ["a red circle"])
    torch.testing.assert_close(first["encoder_hidden_states"], text["prompt_embeds"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(first["encoder_attention_mask"].float(), text["prompt_attention_mask"])
    latents = torch.randn(1, 8, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    sigma0 = first["timestep"][0] / 1000
    shift = family.timestep_shift(2 * 4 * 4)
    t = sigma0 / (shift - (shift - 1) * sigma0)  # the fraction whose shifted level is the pipeline's first
    prepared = family.prepare(latents, text, torch.Generator(), objective=ObjectiveConfig(), t=t.expand(1))
    ours = prepared.inputs
    assert set(ours) <= set(first) and ours["hidden_states"].shape == first["hidden_states"].shape
    for key in ("num_frames", "height", "width", "fps", "use_cross_timestep"):
        assert ours[key] == first[key], key
    assert ours["isolate_modalities"] and not first["isolate_modalities"]  # the joint sampling pass
    for key in ("timestep", "sigma"):
        torch.testing.assert_close(ours[key], first[key].float(), rtol=1e-5, atol=1e-3)
    assert shift > 1
    denoiser = family.load_denoiser()
    with torch.no_grad():
        video = family.predict(denoiser, prepared)
        audio = family.audio_placeholder(denoiser, ours["hidden_states"])
        noisy_audio = {**ours, **{k: torch.randn_like(v) for k, v in audio.items() if k != "audio_encoder_attention_mask"}}
        assert torch.equal(video, denoiser(**noisy_audio, return_dict=False)[0])
        joint = {**ours, **audio, "isolate_modalities": False}
        assert not torch.allclose(video, denoiser(**joint, return_dict=False)[0])


def _ltx23_folder(folder):
    """The tiny LTX-2 pipeline rebuilt with LTX-2.3's architecture and saved as a folder: gated attention
    and prompt modulation in both streams, no caption projection in the transformer, and per-modality text
    projections in the connectors, which then run at the streams' widths."""
    from diffusers import LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    from diffpipe.families.ltx2.flavors import TINY_CONNECTORS, TINY_TRANSFORMER

    pipe = get_family(ModelConfig(family="ltx2")).load_pipeline()
    t = TINY_TRANSFORMER
    torch.manual_seed(0)
    transformer = LTX2VideoTransformer3DModel(**t, gated_attn=True, cross_attn_mod=True, audio_gated_attn=True,
                                              audio_cross_attn_mod=True, use_prompt_embeddings=False)
    connectors = LTX2TextConnectors(**{
        **TINY_CONNECTORS, "per_modality_projections": True, "video_gated_attn": True, "audio_gated_attn": True,
        "video_hidden_dim": t["num_attention_heads"] * t["attention_head_dim"],
        "audio_hidden_dim": t["audio_num_attention_heads"] * t["audio_attention_head_dim"],
        "video_connector_attention_head_dim": t["attention_head_dim"],
        "audio_connector_attention_head_dim": t["audio_attention_head_dim"]})
    type(pipe)(**{**pipe.components, "transformer": transformer, "connectors": connectors}).save_pretrained(folder)
    return folder


def test_ltx2_3_folder_trains_what_the_pipeline_feeds(tmp_path):
    """LTX-2.3 (a local folder of its architecture): the cached text is the connectors' per-modality output
    the pipeline's first transformer call gets, with the same timestep as ``sigma`` (its prompt modulation
    reads it); the video prediction ignores the audio placeholder; a LoRA step reaches every B; the
    pipeline-parallel layers give the denoiser's prediction."""
    from diffpipe.export.keymaps import keymap_for_model
    from diffpipe.models.layers import run_layers
    from diffpipe.training import adapter

    family = get_family(ModelConfig(family="ltx2", flavor="local", path=str(_ltx23_folder(tmp_path / "ltx23"))))
    den = family.load_denoiser()
    assert den.config.cross_attn_mod and not den.config.use_prompt_embeddings and den.prompt_modulation
    first = _first_transformer_call(family, height=32, width=32, num_frames=9, **LTX2_UNGUIDED)
    text = family.encode_text(family.load_text_encoders(), ["a red circle"])
    assert text["prompt_embeds"].shape[-1] == den.config.cross_attention_dim  # the video projection's width
    torch.testing.assert_close(first["encoder_hidden_states"], text["prompt_embeds"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(first["encoder_attention_mask"].float(), text["prompt_attention_mask"])
    sigma0 = first["timestep"][0] / 1000
    shift = family.timestep_shift(2 * 4 * 4)
    t = sigma0 / (shift - (shift - 1) * sigma0)
    latents = torch.randn(1, 8, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    prepared = family.prepare(latents, text, torch.Generator(), objective=ObjectiveConfig(), t=t.expand(1))
    ours = prepared.inputs
    for key in ("timestep", "sigma"):
        torch.testing.assert_close(ours[key], first[key].float(), rtol=1e-5, atol=1e-3)
    with torch.no_grad():
        video = family.predict(den, prepared)
        audio = family.audio_placeholder(den, ours["hidden_states"])
        noisy = {**ours, **{k: torch.randn_like(v) for k, v in audio.items() if k != "audio_encoder_attention_mask"}}
        assert torch.equal(video, den(**noisy, return_dict=False)[0])
        torch.testing.assert_close(run_layers(family.pipeline_layers(den), family.layer_inputs(prepared)), video,
                                   rtol=1e-5, atol=1e-5)
    keymap_for_model("ltx2", den).check_covers(den)  # its gates and prompt modulation have original names
    adapter.add_lora(den, peft.LoraConfig(r=2, lora_alpha=2, target_modules=family.lora_targets(None)))
    family.loss(den, latents, text, torch.Generator().manual_seed(0)).mean().backward()
    b = [p for n, p in den.named_parameters() if "lora_B" in n]
    assert b and all(p.grad is not None and p.grad.abs().sum() > 0 for p in b)


@pytest.mark.parametrize("run", ["cosmos2-video"], indirect=True)
def test_video2world_condition_equals_the_pipeline_construction(run, monkeypatch):
    """Cosmos-Predict2 Video2World: a cached clip's first latent frames are what the stock pipeline's
    ``prepare_latents`` builds from its first frame (an image) or first 5 frames (a video), and the
    loss feeds the transformer exactly what the denoising loop feeds it (hooked on both sides)."""
    cfg, p = run
    from diffusers.pipelines.cosmos import pipeline_cosmos2_video2world as stock

    family = get_family(cfg.model)
    item = sorted(read_spec(p.latent_spec("s0000"))["items"], key=lambda it: it["id"])[0]
    ds = CachedDataset.from_run(p)
    latents = ds.collate([next(i for i, x in enumerate(ds.items) if x.id == item["id"])])["latents"]
    pixels = torch.from_numpy(decode_item((item, False))["pixels"][None])  # the cached clip's pixels
    frames = [wan_i2v.to_pil(pixels[:, :, i : i + 1])[0] for i in range(5)]
    _, h, w = item["bucket"]
    # The pipeline draws its conditioning latents from the VAE's distribution; the cache holds its mean.
    monkeypatch.setattr(stock, "retrieve_latents", lambda out, generator=None, sample_mode="sample": out.latent_dist.mode())
    pipe = family.load_pipeline()
    pipe.set_progress_bar_config(disable=True)
    seen = []
    pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw), with_kwargs=True)
    eps = torch.randn(latents.shape, generator=torch.Generator().manual_seed(0))

    def call(initial, **cond):
        seen.clear()
        with torch.no_grad():
            pipe(prompt="a red circle", **cond, height=h, width=w, num_frames=9, num_inference_steps=2,
                 guidance_scale=1.0, latents=initial, output_type="latent")
        return seen[0]

    for k, cond in [(1, {"image": frames[0]}), (2, {"video": frames})]:
        call(eps, **cond)
        sigma = float(pipe.scheduler.sigmas[0])  # the first step's noise level
        # Our noisy clip x0 + sigma eps, handed over as the initial latents (the pipeline scales them by sigma_max).
        theirs = call((latents + sigma * eps) / pipe.scheduler.config.sigma_max, **cond)
        torch.testing.assert_close(theirs["hidden_states"][:, :, :k], latents[:, :, :k], rtol=1e-5, atol=1e-5)
        t = theirs["timestep"][:, 0, -1, 0, 0]
        seen.clear()
        with torch.no_grad():
            family.loss(pipe.transformer, latents, {"prompt_embeds": theirs["encoder_hidden_states"]},
                        torch.Generator(), t=t, noise=eps, objective=ObjectiveConfig(shift=1.0),
                        conditional_frames=torch.tensor([k]))
        ours = seen[0]
        assert theirs["fps"] == ours["fps"] == 16 and theirs["condition_mask"][0, 0, :, 0, 0].tolist() == [1.0] * k + [0.0] * (3 - k)
        for key in ("hidden_states", "timestep", "condition_mask"):
            torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-5, msg=f"{key}, {k} given")


def _variant_run(tmp_path_factory, clips, tag, model, *, start_image=False, frames=5, sample_frames=5,
                 sample_video=False, **dataset):
    """A family variant's tiny run through every stage: the demo clips in ``frames``-frame buckets, 2 steps,
    the diffusers export, a sample of ``sample_frames`` (from a start image, or continuing the first demo
    clip, where the variant needs one)."""
    monkeypatch = rendezvous()
    root = tmp_path_factory.mktemp(tag)
    sample = {"prompts": ["a red circle"], "steps": 2, "width": 32, "height": 32, "frames": sample_frames}
    if start_image:
        Image.new("RGB", (48, 32), (200, 30, 30)).save(root / "start.png")
        sample["images"] = [str(root / "start.png")]
    if sample_video:
        sample["videos"] = [str(clips / "clip_000.mp4")]
    cfg = {
        "output_dir": "run",
        "model": {"flavor": "tiny", **model},
        "datasets": [{"name": "clips", "path": str(clips), "resolution": 32, "frame_buckets": [frames], **dataset}],
        "cache": {"shards": 1, "workers": 0},
        "train": {"max_steps": 2, "batch_size": 2, "lr": 0.01, "save_every_epochs": 0, "eval": {"quantiles": []}},
        "export": {"formats": ["diffusers"]},
        "sample": sample,
    }
    config = root / f"{tag}.yaml"
    config.write_text(yaml.safe_dump(cfg))
    try:
        run_stages(str(config), cwd=root, monkeypatch=monkeypatch)
    finally:
        monkeypatch.undo()
    return get_family(load_config(config).model), RunPaths(root / "run")


def _lora_reproduces_training(family, pipe, p, output):
    """The exported diffusers file loads into the stock ``pipe``, changes its transformer's ``output`` and
    equals the trained adapter's; the loaded output is returned."""
    base = output(pipe.transformer)
    pipe.load_lora_weights(str(p.export_diffusers))
    loaded = output(pipe.transformer)
    assert (loaded - base).abs().max() > 1e-5, "the LoRA does not change the output"
    torch.testing.assert_close(loaded, output(apply_adapter(family.load_denoiser(), p.adapter_dir)),
                               rtol=1e-5, atol=1e-5)
    return loaded


@pytest.fixture(scope="module")
def ltx2_i2v(demo_clips, tmp_path_factory):
    """LTX-2 image-to-video (``variant: i2v``): clips with their own first frame as the control."""
    return _variant_run(tmp_path_factory, demo_clips / "demo", "ltx2-i2v", {"family": "ltx2", "variant": "i2v"},
                        start_image=True, frames=9, sample_frames=9, control_from_first_frame=True)


def test_ltx2_i2v_trains_what_the_pipeline_feeds(ltx2_i2v, golden, tmp_path):
    """The stock I2V pipeline's first transformer call (recorded) starts from the image's latents, clean,
    at timestep 0 on their tokens, as the loss's input with that image as control; that frame is out of
    the loss; the exported LoRA loads into the I2V pipeline and reproduces training; a saved folder is
    detected as i2v."""
    family, p = ltx2_i2v
    golden("ltx2", "test_video_families::ltx2_i2v", p)
    assert family.uses_control and family.pipeline_class.__name__ == "LTX2ImageToVideoPipeline"
    batch = CachedDataset.from_run(p).collate([0, 1])
    control, latents = batch["control_latents"], batch["latents"]
    assert control.shape == (2, 8, 1, *latents.shape[3:])
    image = Image.new("RGB", (32, 32), (200, 30, 30))
    first = _first_transformer_call(family, image=image, image_crf=0, height=32, width=32, num_frames=9,
                                    **LTX2_UNGUIDED)
    pixels = torch.tensor([200 / 127.5 - 1, 30 / 127.5 - 1, 30 / 127.5 - 1]).view(1, 3, 1, 1, 1).expand(1, 3, 1, 32, 32)
    with torch.no_grad():
        image_latents = family.encode_control(family.load_vae(), pixels, frames=1)["control"]
    sigma0 = first["audio_timestep"][0] / 1000
    shift = family.timestep_shift(2 * 4 * 4)
    t = sigma0 / (shift - (shift - 1) * sigma0)
    text = family.encode_text(family.load_text_encoders(), ["a red circle"])
    x0 = torch.randn(1, 8, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    ours = family.prepare(x0, text, torch.Generator(), objective=ObjectiveConfig(), t=t.expand(1),
                          control=image_latents)
    given = 4 * 4  # the first latent frame's tokens
    torch.testing.assert_close(ours.inputs["hidden_states"][:, :given], first["hidden_states"][:, :given],
                               rtol=1e-5, atol=1e-5)
    assert first["timestep"].shape == (1, 2 * given) and not first["timestep"][:, :given].any()
    for key in ("timestep", "audio_timestep", "sigma"):
        torch.testing.assert_close(ours.inputs[key], first[key].float(), rtol=1e-5, atol=1e-3)
    assert not ours.mask[:, :given].any() and ours.mask[:, given:].min() == 1  # the given frame: no loss

    _lora_reproduces_training(family, family.load_pipeline(), p,
                              lambda denoiser: _denoiser_output(family, denoiser, batch, control=control))
    with av.open(str(p.samples_dir / "sample-00.mp4")) as container:
        assert len(list(container.decode(video=0))) == 9
    with pytest.raises(ValueError, match="sample.images: LTX-2 i2v samples start from an image"):
        family.sample_kwargs(SampleConfig(frames=9))
    family.load_pipeline().save_pretrained(tmp_path)
    assert get_family(ModelConfig(family="ltx2", flavor="local", path=str(tmp_path))).variant == "i2v"
    with pytest.raises(ValueError, match="model.variant i2v needs a control image"):
        family.prepare(latents, batch["text"], torch.Generator(), objective=ObjectiveConfig())


def test_ltx2_first_frame_p_mixes_image_and_text_to_video_items(ltx2_i2v):
    """``model.first_frame_p``: each item is drawn given (its first frame clean, at timestep 0, out of the
    loss: the i2v input) or not (exactly the t2v input on the same clip); the draw follows the generator."""
    family, p = ltx2_i2v
    batch = CachedDataset.from_run(p).collate([0, 1])
    latents, control, text = batch["latents"], batch["control_latents"], batch["text"]
    mixed = get_family(ModelConfig(family="ltx2", variant="i2v", first_frame_p=0.5))
    t2v = get_family(ModelConfig(family="ltx2"))
    t, noise = torch.tensor([0.3, 0.7]), torch.randn(latents.shape, generator=torch.Generator().manual_seed(0))
    given = latents.shape[3] * latents.shape[4]  # the first latent frame's tokens
    plain = t2v.prepare(latents, text, torch.Generator(), objective=ObjectiveConfig(), t=t, noise=noise)
    always = family.prepare(latents, text, torch.Generator(), objective=ObjectiveConfig(), t=t, noise=noise,
                            control=control)
    seen = set()
    for seed in range(16):
        ours = mixed.prepare(latents, text, torch.Generator().manual_seed(seed), objective=ObjectiveConfig(), t=t,
                             noise=noise, control=control)
        drawn = (ours.inputs["timestep"][:, :given] == 0).all(1)
        seen.add(tuple(drawn.tolist()))
        for i, item_given in enumerate(drawn.tolist()):
            like = always if item_given else plain
            torch.testing.assert_close(ours.inputs["hidden_states"][i], like.inputs["hidden_states"][i])
            torch.testing.assert_close(ours.inputs["timestep"][i], like.inputs["timestep"][i].expand(2 * given))  # 2 frames
            assert ours.mask[i, :given].eq(0 if item_given else 1).all()
    assert {(True, False), (False, True)} <= seen  # per item, not per batch
    with pytest.raises(ValueError, match="only ltx2 variant i2v gives first frames"):
        get_family(ModelConfig(family="ltx2", first_frame_p=0.1))
    with pytest.raises(ValueError, match="does not mix image- and text-to-video"):
        get_family(ModelConfig(family="wan", first_frame_p=0.1))


@pytest.fixture(scope="module")
def k5_i2v(demo_clips, tmp_path_factory):
    """Kandinsky 5 image-to-video (``variant: i2v``): clips with their own first frame as the control."""
    return _variant_run(tmp_path_factory, demo_clips / "demo", "kandinsky5-i2v",
                        {"family": "kandinsky5", "variant": "i2v"}, start_image=True, sample_frames=17,
                        control_from_first_frame=True)


def test_kandinsky5_i2v_trains_what_the_pipeline_feeds(k5_i2v, golden, tmp_path):
    """The transformer input is ``Kandinsky5I2VPipeline.prepare_latents``' (first latent frame = the image's
    latents, marked in the condition mask); the exported LoRA loads into the stock I2V pipeline and
    reproduces training; the sample is a clip; a saved folder is detected as i2v."""
    family, p = k5_i2v
    golden("kandinsky5", "test_video_families::k5_i2v", p)
    pipe = family.load_pipeline()
    assert type(pipe).__name__ == "Kandinsky5I2VPipeline" and family.uses_control
    batch = CachedDataset.from_run(p).collate([0, 1])
    control, latents = batch["control_latents"], batch["latents"]
    assert control.shape == (2, 4, 1, *latents.shape[3:])
    b, c, f, h, w = latents.shape
    with torch.no_grad():  # the pipeline's input for the first item's bucket, its image latents drawn by the VAE
        theirs = pipe.prepare_latents(torch.zeros(1, 3, h * 8, w * 8), 1, c, h * 8, w * 8, (f - 1) * 4 + 1,
                                      torch.float32, "cpu", torch.Generator().manual_seed(1), None)
    noise = theirs[..., :c].permute(0, 4, 1, 2, 3)
    text = {k: v[:1] for k, v in batch["text"].items()}
    ours = family.prepare(latents[:1], text, torch.Generator(), objective=ObjectiveConfig(shift=1.0),
                          t=torch.tensor([1.0]), noise=noise, control=noise[:, :, :1])
    torch.testing.assert_close(ours.inputs["hidden_states"], theirs)
    assert ours.mask[:, 0].abs().max() == 0 and ours.mask[:, 1:].min() == 1  # the given frame: no loss

    _lora_reproduces_training(family, pipe, p, lambda denoiser: _denoiser_output(family, denoiser, batch,
                                                                                 control=control))
    with av.open(str(p.samples_dir / "sample-00.mp4")) as container:
        assert len(list(container.decode(video=0))) == 17
    with pytest.raises(ValueError, match="sample.frames 9: Kandinsky 5 i2v samples need at least 17 frames"):
        family.sample_kwargs(SampleConfig(images=["a.png"], frames=9, steps=1, guidance_scale=1.0))
    family.load_pipeline().save_pretrained(tmp_path)
    assert get_family(ModelConfig(family="kandinsky5", flavor="local", path=str(tmp_path))).variant == "i2v"
    with pytest.raises(ValueError, match="holds Kandinsky 5 i2v"):
        get_family(ModelConfig(family="kandinsky5", flavor="local", path=str(tmp_path), variant="t2v"))
    with pytest.raises(ValueError, match="model.variant i2v needs a control image"):
        family.prepare(latents, batch["text"], torch.Generator(), objective=ObjectiveConfig())


@pytest.fixture(scope="module")
def skyreels_df(demo_clips, tmp_path_factory):
    """SkyReels V2 diffusion forcing (``variant: df``): 9-frame clips (3 latent frames, each its own noise level)."""
    return _variant_run(tmp_path_factory, demo_clips / "demo", "skyreels-df", {"family": "skyreels-v2", "variant": "df"},
                        frames=9, sample_frames=9)


def test_skyreels_df_trains_per_frame_levels_as_the_pipeline_feeds_them(skyreels_df, golden, tmp_path):
    """Each latent frame is noised at its own level, non-decreasing along time, and the transformer gets the
    stock diffusion-forcing pipeline's arguments (per-frame timesteps, ``enable_diffusion_forcing``, ``fps``);
    the exported LoRA loads into that pipeline and reproduces training; the sample is a clip; a saved folder is
    detected as ``df``."""
    family, p = skyreels_df
    golden("skyreels-v2", "test_video_families::skyreels_df", p)
    batch = CachedDataset.from_run(p).collate([0, 1])
    latents, text = batch["latents"], batch["text"]
    assert latents.shape[2] == 3 and family.frames_per_block == 1
    eps = torch.randn(latents.shape, generator=torch.Generator().manual_seed(0))
    drawn = family.prepare(latents, text, torch.Generator().manual_seed(3), objective=ObjectiveConfig(), noise=eps)
    levels = drawn.inputs["timestep"] / 1000
    assert levels.shape == (2, 3) and bool((levels.diff(dim=1) >= 0).all()) and levels.unique().numel() == 6
    s = levels[:, None, :, None, None]
    torch.testing.assert_close(drawn.inputs["hidden_states"], (1 - s) * latents + s * eps)
    torch.testing.assert_close(drawn.target, eps - latents)
    given = family.prepare(latents, text, torch.Generator(), objective=ObjectiveConfig(), t=torch.tensor([0.3, 0.7]))
    assert bool((given.inputs["timestep"].diff(dim=1) == 0).all())  # a given level: every frame at it

    pipe = family.load_pipeline()
    assert type(pipe).__name__ == "SkyReelsV2DiffusionForcingPipeline" and pipe.transformer.config.inject_sample_info
    seen = []
    handle = pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw), with_kwargs=True)
    try:
        pipe(prompt="a red circle", **family.sample_kwargs(SampleConfig(steps=1, guidance_scale=1.0, width=32,
             height=32, frames=9)))
    finally:
        handle.remove()
    call = seen[0]
    assert set(call) - {"attention_kwargs", "return_dict"} == set(drawn.inputs)
    assert call["enable_diffusion_forcing"] is True and call["fps"] == drawn.inputs["fps"][:1] == [1]
    assert call["timestep"].shape == (1, 3) and call["hidden_states"].shape[2] == 3

    def output(denoiser):
        with torch.no_grad():
            return family.predict(denoiser, drawn)

    loaded = _lora_reproduces_training(family, pipe, p, output)
    with torch.no_grad():  # two clips in one forward of the frame-rate-embedding transformer: each clip alone
        one = pipe.transformer(**{k: v[1:] if isinstance(v, torch.Tensor | list) else v
                                  for k, v in drawn.inputs.items()}, return_dict=False)[0]
    torch.testing.assert_close(loaded[1:], one, rtol=1e-5, atol=1e-5)
    with av.open(str(p.samples_dir / "sample-00.mp4")) as container:
        assert len(list(container.decode(video=0))) == 9
    pipe.save_pretrained(tmp_path)
    assert get_family(ModelConfig(family="skyreels-v2", flavor="local", path=str(tmp_path))).variant == "df"
    with pytest.raises(ValueError, match="holds SkyReels V2 df"):
        get_family(ModelConfig(family="skyreels-v2", flavor="local", path=str(tmp_path), variant="t2v"))
    with pytest.raises(ValueError, match="skyreels-v2 df: pipeline parallelism is not implemented"):
        family.pipeline_layers(pipe.transformer)
    family.__dict__["frames_per_block"] = 2  # causal blocks of 2 frames: 3 latent frames do not split
    with pytest.raises(ValueError, match="3 latent frames are not whole causal blocks of 2"):
        family.prepare(latents, text, torch.Generator(), objective=ObjectiveConfig())
    counts = {}
    for name in ("skyreels-v2-t2v-14b", "skyreels-v2-df-14b", "skyreels-v2-df-1.3b", "wan2.1-t2v-1.3b"):
        with torch.device("meta"):
            counts[name] = sum(x.numel() for x in PUBLISHED[name].build_meta().parameters())
        assert PUBLISHED[name].params_match(counts[name]), name
    assert counts["skyreels-v2-df-14b"] == counts["skyreels-v2-t2v-14b"]
    # Wan 2.1 1.3B plus the frame-rate embedding (2 x 1536) and its feed-forward (1536 -> 1536 -> 6 x 1536)
    dim = 1536
    fps_parts = 2 * dim + (dim * dim + dim) + (dim * 6 * dim + 6 * dim)
    assert counts["skyreels-v2-df-1.3b"] == counts["wan2.1-t2v-1.3b"] + fps_parts


@pytest.fixture(scope="module")
def skyreels_df_i2v(demo_clips, tmp_path_factory):
    """SkyReels V2 diffusion forcing from an image (``variant: df-i2v``): each clip's own first frame."""
    return _variant_run(tmp_path_factory, demo_clips / "demo", "skyreels-df-i2v",
                        {"family": "skyreels-v2", "variant": "df-i2v"}, start_image=True, frames=9, sample_frames=9,
                        control_from_first_frame=True)


def test_skyreels_df_i2v_starts_from_the_image_as_the_pipeline_does(skyreels_df_i2v, golden, tmp_path):
    """The cached control is the stock DF image-to-video pipeline's condition latents; the first latent frame
    is the image's, at timestep 0 and out of the loss, as the pipeline's first call shows; the LoRA loads into
    that pipeline and reproduces training; the DF weights' folder is accepted for the variant."""
    family, p = skyreels_df_i2v
    golden("skyreels-v2", "test_video_families::skyreels_df_i2v", p)
    assert family.uses_control and family.pipeline_class.__name__ == "SkyReelsV2DiffusionForcingImageToVideoPipeline"
    ds = CachedDataset.from_run(p)
    item = read_spec(p.latent_spec("s0000"))["items"][0]
    batch = ds.collate([ds.items.index(next(x for x in ds.items if x.id == item["id"]))])
    control, latents = batch["control_latents"], batch["latents"]
    pipe = family.load_pipeline()
    first = wan_i2v.to_pil(torch.from_numpy(decode_item((item, False))["pixels"][None, :, :1]))[0]
    _, h, w = item["bucket"]
    with torch.no_grad():
        image = pipe.video_processor.preprocess(first, height=h, width=w)
        _, _, condition, ready = pipe.prepare_latents(image, 1, 16, h, w, 9, torch.float32, "cpu",
                                                      torch.Generator().manual_seed(0))
    assert control.shape == (1, 16, 1, h // 8, w // 8) and ready == 1
    torch.testing.assert_close(control, condition, rtol=1e-5, atol=1e-5)

    eps = torch.randn(latents.shape, generator=torch.Generator().manual_seed(0))
    drawn = family.prepare(latents, batch["text"], torch.Generator().manual_seed(3), objective=ObjectiveConfig(),
                           noise=eps, control=control)
    levels = drawn.inputs["timestep"]
    assert levels[0, 0] == 0 and bool((levels[:, 1:] > 0).all()) and bool((levels.diff(dim=1) >= 0).all())
    torch.testing.assert_close(drawn.inputs["hidden_states"][:, :, :1], control)
    assert drawn.mask[:, :, 0].abs().max() == 0 and drawn.mask[:, :, 1:].min() == 1

    seen = []
    handle = pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw), with_kwargs=True)
    try:
        pipe(prompt="a red circle", image=first, **family.sample_kwargs(SampleConfig(
            steps=1, guidance_scale=1.0, width=w, height=h, frames=9, images=["start.png"])))
    finally:
        handle.remove()
    call = seen[0]
    assert set(call) - {"attention_kwargs", "return_dict"} == set(drawn.inputs) and call["timestep"][0, 0] == 0
    torch.testing.assert_close(call["hidden_states"][:, :, :1], condition)

    batch = ds.collate([0, 1])
    drawn = family.prepare(batch["latents"], batch["text"], torch.Generator().manual_seed(3),
                           objective=ObjectiveConfig(), control=batch["control_latents"])

    def output(denoiser):
        with torch.no_grad():
            return family.predict(denoiser, drawn)

    _lora_reproduces_training(family, pipe, p, output)
    with av.open(str(p.samples_dir / "sample-00.mp4")) as container:
        assert len(list(container.decode(video=0))) == 9
    pipe.save_pretrained(tmp_path)
    assert get_family(ModelConfig(family="skyreels-v2", flavor="local", path=str(tmp_path))).variant == "df"
    local = get_family(ModelConfig(family="skyreels-v2", flavor="local", path=str(tmp_path), variant="df-i2v"))
    assert local.variant == "df-i2v" and local.vae_identity() == family.vae_identity()
    with pytest.raises(ValueError, match="model.variant df-i2v needs a control image"):
        family.prepare(latents, batch["text"], torch.Generator(), objective=ObjectiveConfig())
    with pytest.raises(ValueError, match=r"sample.images: SkyReels V2 df-i2v \(image-to-video\)"):
        family.sample_kwargs(SampleConfig())
    family.__dict__["frames_per_block"] = 3  # the pipeline would not keep the image frame clean
    with pytest.raises(ValueError, match="marks the image's latent frame as ready only in blocks of one frame"):
        family.prepare(latents, {k: v[:1] for k, v in batch["text"].items()},
                       torch.Generator(), objective=ObjectiveConfig(), control=control)


@pytest.fixture(scope="module")
def skyreels_df_v2v(demo_clips, tmp_path_factory):
    """SkyReels V2 diffusion forcing continuing a clip (``variant: df-v2v``): 9-frame clips, a 5-frame prefix."""
    return _variant_run(tmp_path_factory, demo_clips / "demo", "skyreels-df-v2v",
                        {"family": "skyreels-v2", "variant": "df-v2v", "prefix_frames": 5}, frames=9,
                        sample_frames=9, sample_video=True)


def test_skyreels_df_v2v_keeps_the_clips_prefix_as_the_pipeline_does(skyreels_df_v2v, golden):
    """A clip's first 2 latent frames (its first 5 frames) are the stock video-to-video pipeline's prefix
    latents of those frames encoded alone (the causal VAE), given clean at timestep 0 and out of the loss,
    as the pipeline's first transformer call shows; the LoRA loads into that pipeline and reproduces
    training; the sample continues a clip."""
    family, p = skyreels_df_v2v
    golden("skyreels-v2", "test_video_families::skyreels_df_v2v", p)
    assert family.pipeline_class.__name__ == "SkyReelsV2DiffusionForcingVideoToVideoPipeline"
    assert not family.uses_control and family.prefix_latent_frames(3) == 2
    ds = CachedDataset.from_run(p)
    item = read_spec(p.latent_spec("s0000"))["items"][0]
    batch = ds.collate([ds.items.index(next(x for x in ds.items if x.id == item["id"]))])
    latents = batch["latents"]
    pipe = family.load_pipeline()
    frames = wan_i2v.to_pil(torch.from_numpy(decode_item((item, False))["pixels"]).transpose(0, 1))  # the clip's frames
    _, h, w = item["bucket"]
    with torch.no_grad():
        video = pipe.video_processor.preprocess_video(frames[:5], height=h, width=w)
        _, n, prefix, ready = pipe.prepare_latents(video, 1, 16, h, w, 9, torch.float32, "cpu", None,
                                                   overlap_history=5, base_latent_num_frames=3, causal_block_size=1,
                                                   overlap_history_latent_frames=2, long_video_iter=0)
    assert (n, ready) == (3, 2) and latents.shape[2] == 3
    torch.testing.assert_close(latents[:, :, :2], prefix, rtol=1e-4, atol=1e-4)

    eps = torch.randn(latents.shape, generator=torch.Generator().manual_seed(0))
    drawn = family.prepare(latents, batch["text"], torch.Generator().manual_seed(3), objective=ObjectiveConfig(),
                           noise=eps)
    levels = drawn.inputs["timestep"]
    assert bool((levels[:, :2] == 0).all()) and bool((levels[:, 2:] > 0).all())
    torch.testing.assert_close(drawn.inputs["hidden_states"][:, :, :2], latents[:, :, :2])
    assert drawn.mask[:, :, :2].abs().max() == 0 and drawn.mask[:, :, 2:].min() == 1

    seen = []
    handle = pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw), with_kwargs=True)
    try:
        pipe(prompt="a red circle", video=frames[:5], **family.sample_kwargs(SampleConfig(
            steps=1, guidance_scale=1.0, width=w, height=h, frames=9, videos=["clip.mp4"])))
    finally:
        handle.remove()
    call = seen[0]
    assert set(call) - {"attention_kwargs", "return_dict"} == set(drawn.inputs)
    assert bool((call["timestep"][0, :2] == 0).all()) and call["hidden_states"].shape[2] == 3
    torch.testing.assert_close(call["hidden_states"][:, :, :2], prefix, rtol=1e-4, atol=1e-4)

    batch = ds.collate([0, 1])
    drawn = family.prepare(batch["latents"], batch["text"], torch.Generator().manual_seed(3),
                           objective=ObjectiveConfig())

    def output(denoiser):
        with torch.no_grad():
            return family.predict(denoiser, drawn)

    _lora_reproduces_training(family, pipe, p, output)
    with av.open(str(p.samples_dir / "sample-00.mp4")) as container:  # the input clip's 9 frames, then 9 new
        assert len(list(container.decode(video=0))) == 18


def test_skyreels_df_v2v_settings_are_checked():
    def model(**kw):
        return get_family(ModelConfig(family="skyreels-v2", **kw))

    with pytest.raises(ValueError, match="model.prefix_frames: only skyreels-v2 variant df-v2v continues a clip"):
        model(variant="df", prefix_frames=5)
    with pytest.raises(ValueError, match=r"model.prefix_frames 6: give 4k\+1 frames"):
        model(variant="df-v2v", prefix_frames=6)
    family = model(variant="df-v2v")
    assert family.prefix_frames == 17 and family.continues_video
    with pytest.raises(ValueError, match="clips of 5 latent frames leave none after the 5-latent-frame prefix"):
        family.prefix_latent_frames(5)
    with pytest.raises(ValueError, match="sample.videos: SkyReels V2 df-v2v samples continue a clip"):
        family.sample_kwargs(SampleConfig())
    with pytest.raises(ValueError, match="sample.frames 9: .* give more than 17"):
        family.sample_kwargs(SampleConfig(frames=9, videos=["clip.mp4"], steps=1, guidance_scale=1.0))
    from diffpipe.training.sample import _render

    with pytest.raises(ValueError, match="sample.videos: skyreels-v2 samples do not continue a clip"):
        _render(None, model(variant="df"), SampleConfig(videos=["clip.mp4"]), {})
