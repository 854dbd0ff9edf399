"""``diffpipe cache``: build, prune and verify the latent and text caches, one shard per command."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from diffpipe import progress, stages
from diffpipe.cli_common import ConfigOpt, errors, say, setup
from diffpipe.stage_inputs import CacheInputs

cache_app = typer.Typer(help="Encode a cache shard (latents or text embeddings).", no_args_is_help=True)

ShardOpt = Annotated[str, typer.Option("--shard", help="Shard name from the plan, e.g. s0000.")]
RegenerateOpt = Annotated[bool, typer.Option(
    "--regenerate", envvar="DIFFPIPE_REGENERATE",
    help="Encode everything again, ignoring entries already in the store (env DIFFPIPE_REGENERATE=1).")]
TrustOpt = Annotated[bool, typer.Option(
    "--trust", envvar="DIFFPIPE_TRUST",
    help="Skip re-hashing media files against the validate step's sha256 (very large datasets; "
    "env DIFFPIPE_TRUST=1).")]


@cache_app.command("latents")
@errors
def cache_latents_cmd(config: ConfigOpt, shard: ShardOpt, regenerate: RegenerateOpt = False,
                      trust: TrustOpt = False) -> None:
    """Build one latent shard (Zarr), encoding with the VAE only entries the store lacks.

    Example: diffpipe cache latents -c config/demo.yaml --shard s0000
    """
    cfg, paths = setup(config)
    with progress.job(paths.root, f"cache_latents-{shard}", stage="cache latents", shard=shard):
        summary = stages.cache_latents(CacheInputs.of(cfg), paths, shard, regenerate=regenerate, trust=trust)
    say(f"cache latents {shard}: {json.dumps(summary)}")


@cache_app.command("text")
@errors
def cache_text_cmd(config: ConfigOpt, shard: ShardOpt, regenerate: RegenerateOpt = False) -> None:
    """Build one text shard (Arrow), encoding only captions the store lacks.

    Example: diffpipe cache text -c config/demo.yaml --shard s0000
    """
    cfg, paths = setup(config)
    with progress.job(paths.root, f"cache_text-{shard}", stage="cache text", shard=shard):
        summary = stages.cache_text(CacheInputs.of(cfg), paths, shard, regenerate=regenerate)
    say(f"cache text {shard}: {json.dumps(summary)}")


@cache_app.command("empty")
@errors
def cache_empty_cmd(config: ConfigOpt, regenerate: RegenerateOpt = False) -> None:
    """Encode the empty caption once (caption dropout) into cache/text/empty.arrow.

    Example: diffpipe cache empty -c config/demo.yaml
    """
    cfg, paths = setup(config)
    with progress.job(paths.root, "cache_empty_text", stage="cache text", shard="empty"):
        summary = stages.cache_empty(CacheInputs.of(cfg), paths, regenerate=regenerate)
    say(f"cache empty: {json.dumps(summary)}")


@cache_app.command("prune")
@errors
def cache_prune_cmd(config: ConfigOpt) -> None:
    """Delete store shards superseded by newer ones (every entry is also stored elsewhere).

    Example: diffpipe cache prune -c config/demo.yaml
    """
    # Deferred for start-up time, as in every command here: `diffpipe --help` imports this module.
    from diffpipe.data.cache.store import Store, prune

    cfg, paths = setup(config)
    store = Store(paths.cache_store(cfg.cache.dir))
    for kind in ("latents", "text"):
        removed = prune(store, kind, on_wait=lambda: say(
            f"cache prune: waiting for running cache jobs to release {store.root}"))
        say(f"cache prune: removed {len(removed)} superseded {kind} shards from {store.root}")


@cache_app.command("verify")
@errors
def cache_verify_cmd(config: ConfigOpt) -> None:
    """Check that every planned entry is cached under its key, with its shape and checksum.

    Example: diffpipe cache verify -c config/demo.yaml
    """
    from diffpipe.data.cache.reader import CachedDataset  # deferred: imports torch (start-up time)

    _, paths = setup(config)
    summary = CachedDataset.from_run(paths).summary()
    say(f"cache verify: ok, {json.dumps(summary)}")
