"""Caption variants (``datasets[].caption_variants``, ``shuffle_tags``, ``keep_tags``, ``tag_dropout``)."""

from __future__ import annotations

import pytest

from diffpipe.config import parse_config
from diffpipe.data.cache.plan import augment_caption

CAPTION = "sks dog, sitting, on grass, red collar, sunny, park"


def test_variants_are_fixed_per_seed_keep_the_first_tags_and_differ_across_seeds():
    kw = {"keep": 1, "shuffle": True, "dropout": 0.3}
    a = [augment_caption(CAPTION, variant=k, seed=0, **kw) for k in range(6)]
    assert a == [augment_caption(CAPTION, variant=k, seed=0, **kw) for k in range(6)]  # deterministic
    assert a[0] == CAPTION  # variant 0 is the caption itself
    assert all(v.startswith("sks dog") for v in a)
    assert len(set(a[1:])) > 1
    b = [augment_caption(CAPTION, variant=k, seed=1, **kw) for k in range(1, 6)]
    assert b != a[1:]
    for v in a[1:]:  # a permutation of a subset of the tags
        assert set(v.split(", ")) <= set(CAPTION.split(", "))
    assert augment_caption(CAPTION, variant=3, seed=0, keep=0, dropout=0.0, shuffle=False) == CAPTION


def test_config_needs_variants_and_an_augmentation_together():
    base = {"name": "d", "path": "data"}
    with pytest.raises(ValueError, match="caption_variants to 2 or more"):
        parse_config({"datasets": [{**base, "shuffle_tags": True}]})
    with pytest.raises(ValueError, match="would all be the caption itself"):
        parse_config({"datasets": [{**base, "caption_variants": 3}]})
    parse_config({"datasets": [{**base, "caption_variants": 3, "tag_dropout": 0.2}]})
