"""Wan image-to-video (``model.variant: 2.1-i2v``, ``2.1-flf2v``, ``2.2-i2v-a14b``, ``2.2-5b-i2v``) and SkyReels V2
image-to-video (``skyreels-v2``, ``variant: i2v``: Wan 2.1 I2V's conditioning in its own pipeline) on the tiny
flavor, through every real stage.

Clips with ``control_from_first_frame`` (FLF2V: and ``control_from_last_frame``): validate → plan → cache (each
clip's first (and last) frame cached as the pipeline's condition latents, + CLIP hidden states for 2.1)
→ 2 DeepSpeed steps → diffusers export → the stock ``WanImageToVideoPipeline``
(``SkyReelsV2ImageToVideoPipeline``) loads the LoRA → sampling writes an MP4 from ``sample.images``. The cached
conditioning is compared with what the stock pipeline builds from the same
frame, tensor by tensor.

The run's losses and exported LoRA are also compared with the golden values in
``tests/assets/golden_losses.json``; ``DIFFPIPE_UPDATE_GOLDEN=1`` rewrites them
deliberately (see ``tests/golden.py``).
"""

from __future__ import annotations

import json

import av
import pytest
import torch
import yaml
from PIL import Image
from stage_cli import invoke as _cli
from stage_cli import rendezvous, run_stages

from diffpipe.cache_decode import decode_item
from diffpipe.config import DatasetConfig, ModelConfig, ObjectiveConfig, SampleConfig
from diffpipe.data.cache.plan import _entries, read_spec
from diffpipe.data.cache.reader import CachedDataset
from diffpipe.data.dataset.demo_video import write_demo_clips
from diffpipe.families import get_family
from diffpipe.families.published import PUBLISHED
from diffpipe.families.wan import i2v as wan_i2v
from diffpipe.paths import RunPaths
from diffpipe.training.adapter import apply_adapter

pytestmark = pytest.mark.slow


#: (family, variant, expert): Wan 2.1 I2V (CLIP image embedding), Wan 2.1 FLF2V (first and last frame), Wan 2.2
#: I2V-A14B (no image encoder; its high-noise expert, whose LoRA loads into the pipeline's ``transformer``), Wan
#: 2.2 TI2V-5B's image-conditioned mode (the clean first latent frame at timestep 0), SkyReels V2 I2V.
VARIANTS = [("wan", "2.1-i2v", None), ("wan", "2.1-flf2v", None), ("wan", "2.2-i2v-a14b", "high"),
            ("wan", "2.2-5b-i2v", None), ("skyreels-v2", "i2v", None)]
#: The sample size (TI2V-5B's latent grid is 32 pixels a side).
SAMPLE_SIZE = {"2.2-5b-i2v": (64, 32)}


@pytest.fixture(scope="module", params=VARIANTS,
                ids=[v if name == "wan" else f"{name}-{v}" for name, v, _ in VARIANTS])
def i2v_run(tmp_path_factory, request):
    name, variant, expert = request.param
    root = tmp_path_factory.mktemp("wan_i2v")
    write_demo_clips(root / "data", n=2, frames=7, width=48, height=32, fps=16)
    start, end = root / "start.png", root / "end.png"
    Image.new("RGB", (48, 32), (200, 30, 30)).save(start)
    Image.new("RGB", (48, 32), (30, 30, 200)).save(end)
    flf = variant == "2.1-flf2v"
    cfg = {
        "output_dir": "run",
        "model": {"family": name, "flavor": "tiny", "variant": variant, **({"expert": expert} if expert else {})},
        "datasets": [
            {
                "name": "clips",
                "path": str(root / "data"),
                "resolution": 32,
                "frame_buckets": [5],
                "control_from_first_frame": True,
                **({"control_from_last_frame": True} if flf else {}),
            }
        ],
        "cache": {"shards": 1, "workers": 0},
        "train": {"max_steps": 2, "batch_size": 2, "lr": 0.01, "save_every_epochs": 0, "eval": {"quantiles": []}},
        "export": {"formats": ["diffusers"]},
        "sample": {"prompts": ["a red circle"], "images": [str(start)], "steps": 1,
                   **dict(zip(("width", "height"), SAMPLE_SIZE.get(variant, (48, 32)), strict=True)),
                   **({"last_images": [str(end)]} if flf else {})},
    }
    config = root / "i2v.yaml"
    config.write_text(yaml.safe_dump(cfg))
    c = str(config)
    mp = pytest.MonkeyPatch()
    rendezvous(mp)
    paths = RunPaths(root / "run")
    try:
        run_stages(c, cwd=root, monkeypatch=mp, empty_caption=True)
        # A second cache run encodes nothing: the first-frame controls come from the store.
        _cli("cache", "latents", "-c", c, "--shard", "s0000", cwd=root, monkeypatch=mp)
    finally:
        mp.undo()
    return get_family(ModelConfig(**cfg["model"])), paths


def test_golden_losses_and_lora(i2v_run, golden):
    """The 2 losses and the exported LoRA equal the stored golden values (tests/golden.py)."""
    family, p = i2v_run
    tag = family.variant if family.name == "wan" else f"{family.name}-{family.variant}"
    golden(family.name, "test_wan_i2v::i2v_run" + ("" if tag == "2.1-i2v" else f"[{tag}]"), p)


def test_cached_condition_equals_the_pipeline_construction(i2v_run):
    family, p = i2v_run
    items = read_spec(p.latent_spec("s0000"))["items"]
    flf = family.spec.last_frame
    aux = {"first_frame": True, **({"last_frame": True} if flf else {})}
    assert all(it["aux"] == {"control": aux} for it in items) and len(items) == 2
    ds = CachedDataset.from_run(p)
    pipe = family.load_pipeline()
    if family.expand_timesteps:
        _check_ti2v_5b_condition(family, pipe, ds, items)
        return
    assert isinstance(pipe, family.pipeline_class) and pipe.transformer.config.in_channels == 36
    for item in sorted(items, key=lambda it: it["id"]):
        batch = ds.collate([ds.items.index(next(x for x in ds.items if x.id == item["id"]))])
        control, embeds = batch["control_latents"], batch.get("control_embeds")
        pixels = torch.from_numpy(decode_item((item, False))["pixels"][None])
        first, last = wan_i2v.to_pil(pixels[:, :, :1])[0], wan_i2v.to_pil(pixels[:, :, -1:])[0]
        _, h, w = item["bucket"]
        with torch.no_grad():
            image, last_image = (pipe.video_processor.preprocess(x, height=h, width=w) for x in (first, last))
            gen = torch.Generator().manual_seed(0)
            noise, condition = pipe.prepare_latents(
                image, 1, 16, h, w, 5, torch.float32, "cpu", gen, None, last_image if flf else None
            )
        assert control.shape == (1, 16, 2, h // 8, w // 8) and condition.shape[1] == 20
        torch.testing.assert_close(control, condition[:, 4:], rtol=1e-5, atol=1e-5)
        if family.spec.image_embeds:
            with torch.no_grad():
                theirs_embeds = pipe.encode_image([first, last] if flf else first, "cpu")
            assert embeds.shape[:2] == ((1, 2) if flf else (1, 17))
            torch.testing.assert_close(wan_i2v.image_states(embeds), theirs_embeds, rtol=1e-5, atol=1e-5)
        else:  # no image encoder: nothing cached beside the condition latents, as the pipeline passes none
            assert embeds is None and pipe.image_encoder is None and pipe.transformer.config.image_dim is None
            assert pipe.transformer_2.config.in_channels == 36 and pipe.config.boundary_ratio == 0.9
        # The loss's transformer input is the pipeline's ``cat([latents, condition])``.
        ours = wan_i2v.transformer_input(noise, control, family.frame_rule[0], last=flf)
        torch.testing.assert_close(ours, torch.cat([noise, condition], dim=1), rtol=1e-5, atol=1e-5)
    summary = json.loads(p.latent_shard("s0000").with_name(p.latent_shard("s0000").name + ".summary.json").read_text())
    assert (summary["encoded"], summary["reused"]) == (0, 2)


def _check_ti2v_5b_condition(family, pipe, ds, items):
    """TI2V-5B: the cached control is the pipeline's one-frame condition; the loss's transformer input and
    per-token timesteps are the pipeline's, and the clean first frame is left out of the loss."""
    assert isinstance(pipe, family.pipeline_class) and pipe.config.expand_timesteps and pipe.image_encoder is None
    for item in items:
        batch = ds.collate([ds.items.index(next(x for x in ds.items if x.id == item["id"]))])
        control = batch["control_latents"]
        first = wan_i2v.to_pil(torch.from_numpy(decode_item((item, False))["pixels"][None, :, :1]))[0]
        _, h, w = item["bucket"]
        with torch.no_grad():
            image = pipe.video_processor.preprocess(first, height=h, width=w)
            gen = torch.Generator().manual_seed(0)
            noise, condition, first_frame_mask = pipe.prepare_latents(image, 1, 48, h, w, 5, torch.float32, "cpu",
                                                                      gen, None)
        assert control.shape == (1, 48, 1, h // 16, w // 16) and batch.get("control_embeds") is None
        torch.testing.assert_close(control, condition, rtol=1e-5, atol=1e-5)
        # The causal VAE encodes the clip's first frame alone: its own first latent frame is the condition.
        torch.testing.assert_close(batch["latents"][:, :, :1], control, rtol=1e-4, atol=1e-4)
        prepared = family.prepare(batch["latents"], batch["text"], torch.Generator(), objective=ObjectiveConfig(),
                                  t=torch.tensor([0.6]), noise=noise, control=control)
        sigma = prepared.inputs["timestep"] / 1000
        noisy = (1 - sigma) * batch["latents"] + sigma * noise  # the flow interpolation
        theirs = (1 - first_frame_mask) * condition + first_frame_mask * noisy  # the pipeline's model input
        torch.testing.assert_close(prepared.inputs["hidden_states"], theirs, rtol=1e-5, atol=1e-5)
        assert prepared.mask[:, :, 0].abs().max() == 0 and prepared.mask[:, :, 1:].min() == 1
        seen = {}
        handle = pipe.transformer.register_forward_pre_hook(
            lambda m, a, kw, seen=seen: seen.update(timestep=kw["timestep"]), with_kwargs=True
        )
        try:
            with torch.no_grad():
                family.predict(pipe.transformer, prepared)
        finally:
            handle.remove()
        expected = (first_frame_mask[0][0][:, ::2, ::2] * prepared.inputs["timestep"]).flatten()[None]
        torch.testing.assert_close(seen["timestep"], expected)
        assert seen["timestep"].shape == (1, 2 * (h // 32) * (w // 32)) and seen["timestep"][0, 0] == 0


def test_lora_loads_in_stock_i2v_pipeline_and_matches_training(i2v_run):
    family, p = i2v_run
    ds = CachedDataset.from_run(p)
    batch = ds.collate([0, 1])
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(0))

    def output(denoiser):
        out = []
        handle = denoiser.register_forward_hook(lambda m, a, o: out.append(o[0] if isinstance(o, tuple) else o.sample))
        try:
            with torch.no_grad():
                family.loss(
                    denoiser,
                    batch["latents"],
                    batch["text"],
                    torch.Generator(),
                    t=torch.tensor([0.3, 0.7]),
                    noise=noise,
                    control=batch["control_latents"],
                    control_embeds=batch.get("control_embeds"),
                )
        finally:
            handle.remove()
        return out[0]

    pipe = family.load_pipeline()
    base = output(pipe.transformer)
    pipe.load_lora_weights(str(p.export_diffusers))
    loaded = output(pipe.transformer)
    expected = output(apply_adapter(family.load_denoiser(), p.adapter_dir))
    assert (loaded - base).abs().max() > 1e-5, "the LoRA does not change the output"
    torch.testing.assert_close(loaded, expected, rtol=1e-5, atol=1e-5)
    with av.open(str(p.samples_dir / "sample-00.mp4")) as container:
        frames = list(container.decode(video=0))
    assert len(frames) == 5 and (frames[0].width, frames[0].height) == SAMPLE_SIZE.get(family.variant, (48, 32))


def test_first_frame_option_changes_the_key_only_where_it_applies():
    row = {
        "id": "a",
        "path": "/d/a.mp4",
        "sha256": "0" * 64,
        "width": 48,
        "height": 32,
        "frames": 7,
        "fps": 16,
        "kind": "video",
        "reasons": [],
    }
    kw = dict(identity="x", dtype="float32", pixel_multiple=16, fps=16.0, frame_rule=(4, 1))
    plain = _entries(row, DatasetConfig(name="d", path="/d", resolution=32, frame_buckets=[5]), **kw)
    first = _entries(
        row, DatasetConfig(name="d", path="/d", resolution=32, frame_buckets=[5], control_from_first_frame=True), **kw
    )
    assert "aux" not in plain[0] and first[0]["aux"] == {"control": {"first_frame": True}}
    assert plain[0]["key"] != first[0]["key"] and plain[0]["frames"] == first[0]["frames"]
    own = {**row, "control_path": "/c/a.png", "control_sha256": "1" * 64}  # an own control image wins
    with_own = _entries(
        own, DatasetConfig(name="d", path="/d", resolution=32, frame_buckets=[5], control_from_first_frame=True), **kw
    )
    assert with_own[0]["aux"]["control"]["sha256"] == "1" * 64
    # FLF2V: the last frame joins the control (own or first frame) and the key; no control, no last frame
    both = dict(control_from_first_frame=True, control_from_last_frame=True)
    first_last = _entries(row, DatasetConfig(name="d", path="/d", resolution=32, frame_buckets=[5], **both), **kw)
    assert first_last[0]["aux"] == {"control": {"first_frame": True, "last_frame": True}}
    assert first_last[0]["key"] not in (first[0]["key"], plain[0]["key"])
    own_last = _entries(own, DatasetConfig(name="d", path="/d", resolution=32, frame_buckets=[5], **both), **kw)
    assert own_last[0]["aux"]["control"] == {"path": "/c/a.png", "sha256": "1" * 64, "last_frame": True}
    assert own_last[0]["key"] != with_own[0]["key"]
    last_only = DatasetConfig(name="d", path="/d", resolution=32, frame_buckets=[5], control_from_last_frame=True)
    assert "aux" not in _entries(row, last_only, **kw)[0]


@pytest.mark.parametrize(("variant", "last", "message"), [
    ("2.1-flf2v", False, r"datasets\[d\].control_from_last_frame: .* \(wan 2.1-flf2v\) conditions on a first"),
    ("2.1-i2v", True, r"datasets\[d\].control_from_last_frame: .* \(wan 2.1-i2v\) has no last-frame input"),
])
def test_plan_requires_the_last_frame_exactly_for_flf2v(variant, last, message):
    from diffpipe import stages
    from diffpipe.config import Config

    ds = {"name": "d", "path": "/d", "control_from_first_frame": True, "control_from_last_frame": last}
    cfg = Config(model={"family": "wan", "variant": variant}, datasets=[ds])
    with pytest.raises(ValueError, match=message):
        stages.plan(cfg, None)


def test_i2v_errors_and_published_size():
    family = get_family(ModelConfig(family="wan", variant="2.1-i2v"))
    assert family.uses_control and not get_family(ModelConfig(family="wan")).uses_control
    with pytest.raises(ValueError, match="2.1-i2v needs a control image"):
        family.loss(None, torch.zeros(1, 16, 1, 2, 2), {}, torch.Generator(), t=torch.tensor([0.5]))
    with pytest.raises(ValueError, match=r"sample.images: Wan 2.1-i2v \(image-to-video\)"):
        family.sample_kwargs(SampleConfig())
    a14b = get_family(ModelConfig(family="wan", variant="2.2-i2v-a14b", expert="low"))
    assert a14b.uses_control and a14b.boundary_ratio == 0.9 and a14b.denoiser_attr == "transformer_2"
    with pytest.raises(ValueError, match="2.2-i2v-a14b needs a control image"):
        a14b.loss(None, torch.zeros(1, 16, 1, 2, 2), {}, torch.Generator(), t=torch.tensor([0.5]))
    with pytest.raises(ValueError, match=r"model.expert: Wan 2.2 A14B \(variant 2.2-i2v-a14b\) has two experts"):
        get_family(ModelConfig(family="wan", variant="2.2-i2v-a14b"))
    with pytest.raises(ValueError, match="sample.images has 2 path"):
        SampleConfig(prompts=["a"], images=["x.png", "y.png"])
    spec = PUBLISHED["wan2.1-i2v-14b"]
    with torch.device("meta"):
        model = spec.build_meta()
    count = sum(x.numel() for x in model.parameters())
    assert spec.family == "wan" and spec.params_match(count) and count == 16_394_878_784
    assert model.config.in_channels == 36 and model.condition_embedder.image_embedder is not None
    sky = PUBLISHED["skyreels-v2-i2v-14b"]  # Wan 2.1 I2V 14B's architecture in SkyReels V2's class
    with torch.device("meta"):
        sky_model = sky.build_meta()
    assert type(sky_model).__name__ == "SkyReelsV2Transformer3DModel" and sky.family == "skyreels-v2"
    assert sum(x.numel() for x in sky_model.parameters()) == count and sky.params_match(count)
    sky_i2v = get_family(ModelConfig(family="skyreels-v2", variant="i2v"))
    with pytest.raises(ValueError, match=r"sample.images: SkyReels V2 i2v \(image-to-video\)"):
        sky_i2v.sample_kwargs(SampleConfig())
    assert not get_family(ModelConfig(family="skyreels-v2")).uses_control
    with pytest.raises(ValueError, match="skyreels-v2 i2v: pipeline parallelism is not implemented"):
        sky_i2v.pipeline_layers(None)
    with torch.device("meta"):  # FLF2V: the I2V transformer plus a position embedding over two CLIP sequences
        flf = PUBLISHED["wan2.1-flf2v-14b"].build_meta()
    flf_count = sum(x.numel() for x in flf.parameters())
    assert flf_count == count + 2 * 257 * 1280 and PUBLISHED["wan2.1-flf2v-14b"].params_match(flf_count)
    flf2v = get_family(ModelConfig(family="wan", variant="2.1-flf2v"))
    assert flf2v.uses_last_frame and not family.uses_last_frame
    with pytest.raises(ValueError, match="control_from_first_frame: true \\(and control_from_last_frame: true\\)"):
        flf2v.loss(None, torch.zeros(1, 16, 1, 2, 2), {}, torch.Generator(), t=torch.tensor([0.5]))
    with pytest.raises(ValueError, match="sample.last_images: Wan 2.1-flf2v samples end on a given last frame"):
        flf2v.sample_kwargs(SampleConfig(images=["a.png"]))
    with pytest.raises(ValueError, match="sample.last_images: wan has no last-frame input"):
        family.sample_kwargs(SampleConfig(images=["a.png"], last_images=["b.png"]))
    with pytest.raises(ValueError, match="conditions on a first and a last frame, got 1 control frame"):
        flf2v.encode_control(None, torch.zeros(1, 3, 1, 32, 32), frames=5)
    with pytest.raises(ValueError, match="sample.last_images needs sample.images"):
        SampleConfig(last_images=["b.png"])
    counts = {}
    for name in ("wan2.2-t2v-a14b", "wan2.2-i2v-a14b"):  # the I2V model last, checked below
        with torch.device("meta"):
            model = PUBLISHED[name].build_meta()
        counts[name] = sum(x.numel() for x in model.parameters())
    # the T2V-A14B expert plus the patch embedding's 20 more input channels (20 x 2 x 2 x 5120), no image embedder
    assert counts["wan2.2-i2v-a14b"] == counts["wan2.2-t2v-a14b"] + 20 * 4 * 5120
    assert PUBLISHED["wan2.2-i2v-a14b"].params_match(counts["wan2.2-i2v-a14b"])
    assert model.config.in_channels == 36 and model.condition_embedder.image_embedder is None


def test_local_i2v_folder_is_detected_and_cached_like_the_tiny_one(i2v_run, tmp_path):
    family, _ = i2v_run
    family.load_pipeline().save_pretrained(tmp_path)
    # TI2V-5B's folder is detected as such; the image-conditioned mode is asked for and accepted on it.
    mode = family.spec.weights_of
    found = mode or family.variant
    plain = get_family(ModelConfig(family=family.name, flavor="local", path=str(tmp_path), expert=family.expert))
    assert plain.variant == found
    local = get_family(ModelConfig(family=family.name, flavor="local", path=str(tmp_path), expert=family.expert,
                                   variant=family.variant if mode else None))
    assert local.variant == family.variant and local.uses_control and local.pipeline_class is family.pipeline_class
    if family.spec.image_embeds:
        encoder, processor = local.load_image_encoder()
        assert encoder.config.hidden_size == 32 and processor.crop_size == {"height": 32, "width": 32}
    elif mode:
        assert local.expand_timesteps and local.boundary_ratio is None and not (tmp_path / "image_encoder").exists()
    else:
        assert local.boundary_ratio == 0.9 and not (tmp_path / "image_encoder").exists()
    assert local.vae_identity() == family.vae_identity()  # the same VAE (+ image encoder), the same cache keys
    with pytest.raises(ValueError, match=f"holds {family.model_label} {found}"):
        get_family(ModelConfig(family=family.name, flavor="local", path=str(tmp_path),
                               variant="2.1" if family.name == "wan" else "t2v"))
