import pytest

from diffpipe.data.cache.frames import (
    frame_bucket,
    resample_indices,
    resampled_length,
    snap_frames,
    valid_frame_count,
)


def test_frame_rule_4k_plus_1():
    assert [n for n in range(1, 20) if valid_frame_count(n)] == [1, 5, 9, 13, 17]
    assert [snap_frames(n) for n in (0, 1, 4, 5, 8, 16, 17, 18)] == [0, 1, 1, 5, 5, 13, 17, 17]
    assert snap_frames(10, step=8, offset=1) == 9 and valid_frame_count(16, step=8, offset=0)


def test_resampling_lengths_and_indices():
    assert resampled_length(300, 30, 24) == 240  # 10 s, not 239
    assert resampled_length(48, 24, 24) == 48
    assert resample_indices(10, 24, 24, 5) == [0, 1, 2, 3, 4]
    assert resample_indices(60, 60, 24, 5) == [0, 2, 5, 7, 10]  # 60 fps -> 24 fps
    assert resample_indices(12, 12, 24, 5) == [0, 0, 1, 1, 2]  # upsampling repeats frames
    with pytest.raises(ValueError, match="too short"):
        resample_indices(4, 24, 24, 5)
    with pytest.raises(ValueError, match="positive"):
        resampled_length(10, 0, 24)


def test_frame_bucket_picks_the_longest_fitting_valid_count():
    assert frame_bucket(100, 24, 24) == 97
    assert frame_bucket(100, 24, 24, [17, 33, 200]) == 33
    assert frame_bucket(100, 48, 24, [16, 33, 49]) == 49  # 50 frames at 24 fps; 16 snaps to 13
    assert (
        frame_bucket(10, 24, 24, [17, 33]) == 0
    )  # too short for every bucket: reported, not guessed


def test_dataset_weight_scales_repeats():
    from diffpipe.data.cache.plan import effective_repeats

    assert effective_repeats(1, 1.0) == 1
    assert effective_repeats(2, 3.0) == 6
    assert effective_repeats(1, 2.4) == 2
    assert effective_repeats(3, 0.1) == 1  # never dropped
