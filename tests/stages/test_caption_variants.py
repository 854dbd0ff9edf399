"""Caption variants through plan, the text cache and training.

Two datasets over the same demo images; the second gets 3 caption variants. The text spec holds each
variant once, the text cache encodes each distinct variant once; changing only the second dataset's
augmentation re-encodes only the new variants; training reads more than one variant across epochs,
and evaluation reads the caption itself.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import yaml

from diffpipe import stages
from diffpipe.config import load_config
from diffpipe.data.cache.plan import read_spec
from diffpipe.data.cache.reader import CachedDataset
from diffpipe.paths import RunPaths

pytestmark = pytest.mark.slow


def _config(root, seed: int) -> dict:
    return {"output_dir": str(root / "run"), "cache": {"shards": 1},
            "datasets": [{"name": "plain", "path": str(root / "a"), "resolution": 32},
                         {"name": "aug", "path": str(root / "b"), "resolution": 32, "caption_variants": 3,
                          "shuffle_tags": True, "caption_seed": seed}]}


def _captions(root, tiny_run) -> None:
    for name in ("a", "b"):
        shutil.copytree(tiny_run.root / "data", root / name)
        for txt in (root / name).glob("*.txt"):  # tags to shuffle
            txt.write_text(f"{txt.stem}, a shape, bright colour, plain background, centred")


def test_variants_are_cached_once_each_and_reencoded_only_when_they_change(tiny_run, tmp_path):
    _captions(tmp_path, tiny_run)
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(yaml.safe_dump(_config(tmp_path, seed=0)))
    cfg = load_config(cfg_file)
    paths = RunPaths(cfg.output_dir)
    stages.prepare_data(cfg, paths, empty_caption=False)
    spec = read_spec(paths.text_spec(paths.shard_names("text")[0]))
    ids = [t["id"] for t in spec["items"]]
    n = len(list((tmp_path / "a").glob("*.png")))
    assert len(ids) == n + 3 * n and sum("~c" in i for i in ids) == 2 * n
    keys = {t["key"] for t in spec["items"]}

    data = CachedDataset.from_run(paths)
    aug = [i for i, it in enumerate(data.items) if it.text_variants]
    assert len(aug) == n and all(len(data.items[i].text_variants) == 2 for i in aug)
    same_bucket = [i for i in aug if data.items[i].bucket == data.items[aug[0]].bucket][:2]
    per_epoch = [data.collate(same_bucket, epoch=e)["text"]["prompt_embeds"] for e in range(8)]
    assert any(not torch.equal(per_epoch[0], x) for x in per_epoch[1:]), "one variant every epoch"
    assert torch.equal(data.collate(same_bucket, epoch=3)["text"]["prompt_embeds"],
                       data.collate(same_bucket, epoch=3)["text"]["prompt_embeds"])  # fixed per epoch
    evals = data.collate(same_bucket)["text"]["prompt_embeds"]  # no epoch: variant 0
    rows = [data.items[i].text_row for i in same_bucket]
    assert torch.equal(evals, data._text["prompt_embeds"][rows].float())

    # Another seed for the augmented dataset only: its new variants are encoded, nothing else.
    cfg_file.write_text(yaml.safe_dump(_config(tmp_path, seed=1)))
    cfg = load_config(cfg_file)
    stages.plan(cfg, paths)
    new_keys = {t["key"] for t in read_spec(paths.text_spec(paths.shard_names("text")[0]))["items"]}
    summary = stages.cache_text(cfg, paths, paths.shard_names("text")[0])
    assert summary["encoded"] == len(new_keys - keys) > 0
    assert summary["reused"] == len(new_keys & keys)
