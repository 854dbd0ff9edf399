"""``cache``: the latent and text-embedding caches (shards, dtype, the shared store)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from diffpipe.config.base import MAX_BATCH, MAX_SHARDS, MAX_WORKERS, Int, PathText, Section


class CacheConfig(Section):
    shards: Int = Field(2, description="Number of cache shards (one Snakemake job each).", ge=1, le=MAX_SHARDS)
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Storage dtype of cached tensors.")
    batch_size: Int = Field(8, description="Encoder batch size in cache jobs.", ge=1, le=MAX_BATCH)
    dir: PathText | None = Field(
        None,
        description="Content-addressed store that cache jobs reuse entries from; share it across runs and "
        "datasets. null = `<output_dir>/cache/store`.",
    )
    workers: Int = Field(
        2, description="Decoding worker processes per latent cache job (0: decode inline).", ge=0, le=MAX_WORKERS
    )
