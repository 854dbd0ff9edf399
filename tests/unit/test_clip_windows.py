"""Which frames of a clip become training items: ``datasets[].clip_windows`` and the plan's item ids."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from diffpipe.config import CacheConfig, DatasetConfig
from diffpipe.data.cache.frames import clip_windows, strided_indices, window_starts
from diffpipe.data.cache.plan import make_plan, read_spec
from diffpipe.paths import RunPaths


def test_first_window_is_the_clips_first_frames_at_the_model_rate():
    # 32 frames at 32 fps -> 16 at 16 fps; bucket 9 (4k+1): every second source frame from 0.
    assert clip_windows(32, 32.0, 16.0, [9]) == [[0, 2, 4, 6, 8, 10, 12, 14, 16]]
    assert clip_windows(4, 16.0, 16.0, [5]) == []  # shorter than every bucket: no window


def test_uniform_spreads_one_window_over_the_whole_clip():
    (w,) = clip_windows(100, 16.0, 16.0, [9], mode="uniform")
    assert len(w) == 9 and w == list(range(w[0], w[0] + 9 * 12, 12))  # one even stride of 12 frames
    assert w[-1] - w[0] == 96 and w[0] == 1  # spans the clip, centred
    # A clip slower than the model's rate has no stride to spread: frames repeat as when resampling.
    assert clip_windows(6, 8.0, 16.0, [9], mode="uniform") == [[0, 0, 1, 1, 2, 2, 3, 3, 4]]
    assert strided_indices(5, 5) == [0, 1, 2, 3, 4]


def test_multiple_gives_non_overlapping_windows_spread_over_the_clip():
    wins = clip_windows(40, 16.0, 16.0, [9], mode="multiple")
    assert [w[0] for w in wins] == [0, 10, 20, 31]  # 40 // 9 = 4 windows and all(len(w) == 9 for w in wins)
    assert all(a[-1] < b[0] for a, b in zip(wins, wins[1:], strict=False))
    assert wins[0] == clip_windows(40, 16.0, 16.0, [9])[0]  # window 0 is the `first` window
    assert clip_windows(40, 16.0, 16.0, [9], mode="multiple", count=2) == [wins[0], list(range(31, 40))]
    assert window_starts(9, 9) == [0] and window_starts(8, 9) == []
    with pytest.raises(ValueError, match="clip_windows 'middle'"):
        clip_windows(40, 16.0, 16.0, [9], mode="middle")


def _manifest(path, rows):
    cols = ["id", "dataset", "path", "sha256", "width", "height", "frames", "caption", "status", "fps", "kind"]
    pq.write_table(pa.table({c: [r[c] for r in rows] for c in cols}), path)


def test_plan_makes_an_item_per_window_with_stable_ids(tmp_path):
    rows = [
        {
            "id": "0a",
            "dataset": "v",
            "path": "long.mp4",
            "sha256": "aa",
            "width": 32,
            "height": 32,
            "frames": 40,
            "caption": "x",
            "status": "ok",
            "fps": 16.0,
            "kind": "video",
        },
        {
            "id": "0b",
            "dataset": "v",
            "path": "short.mp4",
            "sha256": "bb",
            "width": 32,
            "height": 32,
            "frames": 3,
            "caption": "y",
            "status": "ok",
            "fps": 16.0,
            "kind": "video",
        },
    ]
    _manifest(tmp_path / "manifest.parquet", rows)

    def plan(mode):
        paths = RunPaths(tmp_path / mode)
        ds = DatasetConfig(name="v", path=".", resolution=32, frame_buckets=[9], clip_windows=mode)
        result = make_plan(
            tmp_path / "manifest.parquet",
            [ds],
            CacheConfig(shards=1),
            latent_identity="L",
            text_identity="T",
            pixel_multiple=16,
            paths=paths,
            fps=16.0,
        )
        return result, {e["id"]: e for e in read_spec(paths.latent_spec("s0000"))["items"]}

    first, one = plan("first")
    multi, many = plan("multiple")
    assert first.too_short == multi.too_short == ["short.mp4"]  # reported, never planned (nor cached)
    assert list(one) == ["0a"] and list(many) == ["0a", "0a#w1", "0a#w2", "0a#w3"]
    assert many["0a"]["key"] == one["0a"]["key"]  # window 0 keeps its id and its cache entry
    assert {e["item"] for e in many.values()} == {"0a"}  # every window trains on the clip's caption
    assert many["0a#w3"]["frames"] == list(range(31, 40))
    assert multi.entries == 4 and multi.items == 1
