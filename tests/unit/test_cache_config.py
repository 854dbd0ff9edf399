import pytest

from diffpipe.config import ConfigError, DatasetConfig, parse_config
from diffpipe.data.cache.buckets import dataset_ratios
from diffpipe.paths import RunPaths


def test_bucket_fields_and_their_checks(tmp_path):
    ds = DatasetConfig(name="d", path=".", resolution=64, resolutions=[128, 64, 128])
    assert ds.training_resolutions() == [64, 128]
    assert DatasetConfig(name="d", path=".").training_resolutions() == [64]
    assert dataset_ratios(DatasetConfig(name="d", path=".")) is None  # the classic nine
    assert len(dataset_ratios(DatasetConfig(name="d", path=".", ar_buckets=5))) == 5
    assert dataset_ratios(DatasetConfig(name="d", path=".", aspect_ratios=[2, 0.5])) == (0.5, 2)
    with pytest.raises(ConfigError, match="min_ar"):
        parse_config({"datasets": [{"name": "d", "path": ".", "min_ar": 3, "max_ar": 2}]})
    with pytest.raises(ConfigError, match="crop"):
        parse_config({"datasets": [{"name": "d", "path": ".", "crop": "top"}]})


def test_cache_store_location():
    paths = RunPaths("/runs/a")
    assert paths.cache_store() == RunPaths("/runs/a").root / "cache" / "store"
    assert str(paths.cache_store("/shared/cache")) == "/shared/cache"
