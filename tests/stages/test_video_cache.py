"""Video clips in cache jobs: streamed decoding of the planned frames, encoded next to images.

Tiny clips are written with PyAV in the test; frame ``i`` is a flat grey of
level ``20 * i``, so which source frame landed where is visible in the pixels.
"""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import pytest
import torch
import yaml
from stage_cli import invoke as _cli
from typer.testing import CliRunner

from diffpipe.cli import app
from diffpipe.config import load_config
from diffpipe.data.cache.latents import LatentShard, storage_to_tensor
from diffpipe.data.cache.plan import read_spec
from diffpipe.data.cache.video import load_video_array, select_frames
from diffpipe.data.dataset.demo import write_demo_dataset
from diffpipe.families import get_family
from diffpipe.paths import RunPaths


def write_clip(path: Path, n: int, fps: int = 8, size: tuple[int, int] = (32, 48)) -> None:
    """``n`` flat grey frames (level ``20 * i``), H.264 in MP4 when available, else MPEG-4."""
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    h, w = size
    with av.open(str(path), "w", format="mp4") as c:
        s = c.add_stream(codec, rate=fps)
        s.height, s.width, s.pix_fmt = h, w, "yuv420p"
        for i in range(n):
            frame = av.VideoFrame.from_ndarray(np.full((h, w, 3), 20 * i, np.uint8), format="rgb24")
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def test_select_frames_stops_after_the_last_wanted_frame():
    consumed = []

    def source():
        for i in range(1000):
            consumed.append(i)
            yield i

    got = list(select_frames(source(), [0, 0, 2, 5]))
    assert got == [([0, 1], 0), ([2], 2), ([3], 5)]
    assert consumed == list(range(6))  # nothing after frame 5 is decoded


def test_load_video_array_keeps_the_planned_frames(tmp_path):
    clip = tmp_path / "c.mp4"
    write_clip(clip, 10)
    arr = load_video_array(clip, (16, 16), [1, 3, 3, 8])
    assert arr.shape == (3, 4, 16, 16) and arr.dtype == np.float32
    levels = (arr.mean(axis=(0, 2, 3)) + 1) * 127.5
    np.testing.assert_allclose(levels, [20, 60, 60, 160], atol=4)
    with pytest.raises(ValueError, match="ended after"):
        load_video_array(clip, (16, 16), [0, 12])


def test_cache_latents_encodes_clips_and_images(tmp_path, monkeypatch):
    data = tmp_path / "data"
    write_demo_dataset(data, n=2, size=32)
    write_clip(data / "clip_a.mp4", 12)
    write_clip(data / "clip_b.mp4", 3, fps=24)  # shorter than every frame bucket: reported, not cached
    for name in ("clip_a", "clip_b"):
        (data / f"{name}.txt").write_text(f"a grey fade {name}")
    cfg = {
        "output_dir": "run",
        "model": {"family": "sd", "flavor": "tiny"},
        "datasets": [{"name": "mixed", "path": str(data), "resolution": 32, "frame_buckets": [5]}],
        "cache": {"shards": 1, "workers": 0},
    }
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(cfg))
    for stage in (["validate"], ["plan"], ["cache", "latents", "--shard", "s0000"]):
        _cli(*stage, "-c", str(config), cwd=tmp_path, monkeypatch=monkeypatch)
    paths = RunPaths(tmp_path / "run")
    spec = read_spec(paths.latent_spec("s0000"))
    assert not any(it["path"].endswith("clip_b.mp4") for it in spec["items"])  # too short: left out
    clip = next(it for it in spec["items"] if it["path"].endswith("clip_a.mp4"))
    # 12 frames at 8 fps resampled to the family's 24 fps: 36 frames, bucket 5 (first window).
    assert clip["bucket"][0] == 5 and clip["frames"] == [0, 0, 0, 1, 1]
    assert sum(it["bucket"][0] == 1 and not it["frames"] for it in spec["items"]) == 2  # images: single frames

    shard = LatentShard(paths.latent_shard("s0000"))
    arrays = shard.load()
    row = shard.meta[clip_bucket := "x".join(map(str, clip["bucket"]))]["ids"].index(clip["id"])
    cached = storage_to_tensor(arrays[clip_bucket][row], shard.dtype)
    family = get_family(load_config(config).model)
    pixels = torch.from_numpy(load_video_array(clip["path"], tuple(clip["bucket"][1:]), clip["frames"]))
    expected = family.encode_pixels(family.load_vae(), pixels[None])[0]
    assert cached.shape == expected.shape and cached.shape[1] == 5
    torch.testing.assert_close(cached.float(), expected.to(cached.dtype).float())


def test_one_frame_clip_is_planned_as_video(tmp_path):
    """A one-frame clip (possible without frame buckets) is decoded by PyAV, never by the image loader."""
    from diffpipe.config import DatasetConfig
    from diffpipe.data.cache.plan import _entries

    write_clip(tmp_path / "one.mp4", 1)
    row = {"id": "ab", "path": str(tmp_path / "one.mp4"), "sha256": "0", "width": 48, "height": 32,
           "frames": 1, "fps": None, "kind": "video"}
    kw = dict(identity="v", dtype="float32", pixel_multiple=16, fps=16.0, frame_rule=(4, 1))
    ds = DatasetConfig(name="d", path=str(tmp_path), resolution=32)
    [entry] = _entries(row, ds, **kw)
    assert entry["bucket"] == [1, 32, 48] and entry["frames"] == [0]
    assert load_video_array(row["path"], (32, 48), entry["frames"]).shape == (3, 1, 32, 48)
    [image] = _entries({**row, "kind": "image"}, ds, **kw)
    assert image["frames"] is None and image["key"] != entry["key"]


def test_demo_video_config_and_clips(tmp_path, monkeypatch):
    """``config/demo-video.yaml`` plans its images and committed clips (9 frames, Wan's 16 fps)."""
    from diffpipe.data.dataset.demo_video import demo_clip
    from diffpipe.paths import REPO_ROOT

    cfg = yaml.safe_load((REPO_ROOT / "config" / "demo-video.yaml").read_text())
    clips = sorted((REPO_ROOT / "config" / "demo_video_data").glob("*.mp4"))
    assert len(clips) == 4
    for i, clip in enumerate(clips):  # the committed clips are the generator's (lossy codec: approx.)
        with av.open(str(clip)) as c:
            decoded = [np.asarray(f.to_image(), dtype=np.float32) for f in c.decode(video=0)]
        expected = [np.asarray(f, dtype=np.float32) for f in demo_clip(i, frames=9, width=48, height=32)[0]]
        assert len(decoded) == 9 and np.abs(np.stack(decoded) - np.stack(expected)).mean() < 8
    cfg["output_dir"] = str(tmp_path / "run")
    for ds in cfg["datasets"]:
        ds["path"] = str(REPO_ROOT / ds["path"])
    config = tmp_path / "demo-video.yaml"
    config.write_text(yaml.safe_dump(cfg))
    for stage in ("validate", "plan"):
        _cli(stage, "-c", str(config), cwd=tmp_path, monkeypatch=monkeypatch)
    spec = read_spec(RunPaths(tmp_path / "run").latent_spec("s0000"))["items"]
    spec += read_spec(RunPaths(tmp_path / "run").latent_spec("s0001"))["items"]
    assert sorted({it["bucket"][0] for it in spec}) == [1, 9]
    assert sum(it["bucket"][0] == 9 for it in spec) == 4 and len(spec) == 20


def test_demo_data_command_writes_clips(tmp_path):
    result = CliRunner().invoke(app, ["demo-data", str(tmp_path), "--n", "1", "--size", "32", "--clips", "1",
                                      "--frames", "5"])
    assert result.exit_code == 0, result.output
    with av.open(str(tmp_path / "clip_000.mp4")) as c:
        assert len(list(c.decode(video=0))) == 5
    assert (tmp_path / "clip_000.txt").read_text().startswith("a ")


def test_image_families_keep_the_default_frame_settings():
    from diffpipe.config import ModelConfig

    sd, wan = get_family(ModelConfig(family="sd")), get_family(ModelConfig(family="wan"))
    assert (sd.is_video, sd.fps, sd.frame_rule) == (False, 24.0, (4, 1))
    assert (wan.is_video, wan.fps, wan.frame_rule, wan.pixel_multiple) == (True, 16.0, (4, 1), 16)
