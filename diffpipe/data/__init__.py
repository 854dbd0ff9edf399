"""Data stages, in two packages: ``dataset`` (discovery, captions and metadata, checks and policy,
validation, the manifest and its report) and ``cache`` (the shard plan with its buckets and frames,
the content-addressed store, the latent and text formats, the reader; the cache jobs that encode with a family are ``diffpipe.cache_jobs``).

Exports resolve lazily (PEP 562): the Snakefile imports ``dataset_files``
while building its DAG, and that must not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "bucket_sizes": "cache.buckets",
    "choose_bucket": "cache.buckets",
    "load_image": "cache.buckets",
    "log_spaced_ratios": "cache.buckets",
    "frame_bucket": "cache.frames",
    "resample_indices": "cache.frames",
    "snap_frames": "cache.frames",
    "Store": "cache.store",
    "to_rgb": "cache.buckets",
    "write_demo_dataset": "dataset.demo",
    "dataset_files": "dataset.discover",
    "LatentEntry": "cache.latents",
    "LatentShard": "cache.latents",
    "write_latent_shard": "cache.latents",
    "PlanResult": "cache.plan",
    "make_plan": "cache.plan",
    "read_spec": "cache.plan",
    "CachedDataset": "cache.reader",
    "print_summary": "dataset.validate",
    "TextShard": "cache.text",
    "write_text_shard": "cache.text",
    "REASONS": "dataset.validate",
    "Issue": "dataset.results",
    "ValidationResult": "dataset.results",
    "run_validation": "dataset.validate",
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
    from diffpipe.data.cache.buckets import (
        bucket_sizes,
        choose_bucket,
        load_image,
        log_spaced_ratios,
        to_rgb,
    )
    from diffpipe.data.cache.frames import frame_bucket, resample_indices, snap_frames
    from diffpipe.data.cache.latents import LatentEntry, LatentShard, write_latent_shard
    from diffpipe.data.cache.plan import PlanResult, make_plan, read_spec
    from diffpipe.data.cache.reader import CachedDataset
    from diffpipe.data.cache.store import Store
    from diffpipe.data.cache.text import TextShard, write_text_shard
    from diffpipe.data.dataset.demo import write_demo_dataset
    from diffpipe.data.dataset.discover import dataset_files
    from diffpipe.data.dataset.validate import (
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
