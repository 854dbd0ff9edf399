"""Data stages: discovery, validation, buckets, shard plan, cache write and read.

Exports resolve lazily (PEP 562): the Snakefile imports ``dataset_files``
while building its DAG, and that must not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "bucket_sizes": "buckets",
    "choose_bucket": "buckets",
    "load_image": "buckets",
    "log_spaced_ratios": "buckets",
    "frame_bucket": "frames",
    "resample_indices": "frames",
    "snap_frames": "frames",
    "Store": "store",
    "to_rgb": "buckets",
    "cache_empty_text": "cache",
    "cache_latents": "cache",
    "cache_text": "cache",
    "write_demo_dataset": "demo",
    "dataset_files": "discover",
    "LatentEntry": "latents",
    "LatentShard": "latents",
    "write_latent_shard": "latents",
    "PlanResult": "plan",
    "make_plan": "plan",
    "read_spec": "plan",
    "CachedDataset": "reader",
    "print_summary": "validate",
    "TextShard": "text",
    "write_text_shard": "text",
    "REASONS": "validate",
    "Issue": "validate",
    "ValidationResult": "validate",
    "run_validation": "validate",
}

__all__ = [
    "CachedDataset",
    "Issue",
    "LatentEntry",
    "LatentShard",
    "PlanResult",
    "Store",
    "REASONS",
    "TextShard",
    "ValidationResult",
    "bucket_sizes",
    "cache_empty_text",
    "cache_latents",
    "cache_text",
    "choose_bucket",
    "dataset_files",
    "frame_bucket",
    "load_image",
    "log_spaced_ratios",
    "make_plan",
    "print_summary",
    "read_spec",
    "resample_indices",
    "run_validation",
    "snap_frames",
    "to_rgb",
    "write_demo_dataset",
    "write_latent_shard",
    "write_text_shard",
]

if TYPE_CHECKING:
    from diffpipe.data.buckets import (
        bucket_sizes,
        choose_bucket,
        load_image,
        log_spaced_ratios,
        to_rgb,
    )
    from diffpipe.data.cache import cache_empty_text, cache_latents, cache_text
    from diffpipe.data.demo import write_demo_dataset
    from diffpipe.data.discover import dataset_files
    from diffpipe.data.frames import frame_bucket, resample_indices, snap_frames
    from diffpipe.data.latents import LatentEntry, LatentShard, write_latent_shard
    from diffpipe.data.plan import PlanResult, make_plan, read_spec
    from diffpipe.data.reader import CachedDataset
    from diffpipe.data.store import Store
    from diffpipe.data.text import TextShard, write_text_shard
    from diffpipe.data.validate import (
        REASONS,
        Issue,
        ValidationResult,
        print_summary,
        run_validation,
    )


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'diffpipe.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"diffpipe.data.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
