"""The ``diffpipe`` command line: one thin command per stage, plus ``run`` and ``schema``.

Each command parses its arguments and calls one library function; errors a
user can fix print a clear message and exit 2 (usage/config) or 1 (data/run).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from diffpipe.config import ConfigError, load_config
from diffpipe.paths import RunPaths

app = typer.Typer(
    help="diffpipe: fingerprinted data → sharded caches → DeepSpeed LoRA training → export → samples.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
cache_app = typer.Typer(help="Encode a cache shard (latents or text embeddings).", no_args_is_help=True)
app.add_typer(cache_app, name="cache")
console = Console(stderr=True)

ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="Experiment config (YAML).")]
ShardOpt = Annotated[str, typer.Option("--shard", help="Shard name from the plan, e.g. s0000.")]


def _errors(fn):
    """Turn library errors into clean messages and exit codes."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ConfigError as err:
            console.print(f"[bold red]config error:[/] {err}")
            raise typer.Exit(2) from None
        except (ValueError, FileNotFoundError) as err:
            console.print(f"[bold red]error:[/] {err}")
            raise typer.Exit(1) from None

    return wrapper


def _setup(config: Path):
    cfg = load_config(config)
    return cfg, RunPaths(cfg.output_dir)


@app.command()
@_errors
def validate(
    config: ConfigOpt,
    rehash: Annotated[bool, typer.Option(help="Re-read every file even if size and mtime are unchanged.")] = False,
) -> None:
    """Scan the datasets, fingerprint every file, write the manifest and reports.

    Example: diffpipe validate -c config/demo.yaml
    """
    from diffpipe.data.validate import print_summary, run_validation

    cfg, paths = _setup(config)
    result = run_validation(cfg.datasets, cfg.validation, manifest_path=paths.manifest,
                            report_json=paths.report_json, report_html=paths.report_html, rehash=rehash)
    print_summary(result, console=console)
    if result.errors:
        raise typer.Exit(1)


@app.command()
@_errors
def plan(config: ConfigOpt) -> None:
    """Assign manifest items to cache shards and write one spec file per shard.

    Example: diffpipe plan -c config/demo.yaml
    """
    from diffpipe.data.plan import make_plan
    from diffpipe.models import get_family

    cfg, paths = _setup(config)
    family = get_family(cfg.model)
    result = make_plan(paths.manifest, cfg.datasets, cfg.cache, latent_identity=family.vae_identity(),
                       text_identity=family.text_identity(), pixel_multiple=family.pixel_multiple, paths=paths)
    console.print(f"plan: {result}")


@cache_app.command("latents")
@_errors
def cache_latents_cmd(config: ConfigOpt, shard: ShardOpt) -> None:
    """Encode one shard's media with the VAE into Zarr.

    Example: diffpipe cache latents -c config/demo.yaml --shard s0000
    """
    from diffpipe.data.cache import cache_latents

    cfg, paths = _setup(config)
    summary = cache_latents(paths.latent_spec(shard), paths.latent_shard(shard), cfg.model, cfg.cache)
    console.print(f"cache latents {shard}: {json.dumps(summary)}")


@cache_app.command("text")
@_errors
def cache_text_cmd(config: ConfigOpt, shard: ShardOpt) -> None:
    """Encode one shard's captions with the text encoder(s) into Arrow.

    Example: diffpipe cache text -c config/demo.yaml --shard s0000
    """
    from diffpipe.data.cache import cache_text

    cfg, paths = _setup(config)
    summary = cache_text(paths.text_spec(shard), paths.text_shard(shard), cfg.model, cfg.cache)
    console.print(f"cache text {shard}: {json.dumps(summary)}")


@app.command()
@_errors
def train(
    config: ConfigOpt,
    processes: Annotated[int, typer.Option(help="Local processes (one per GPU; CPU: gloo).")] = 1,
) -> None:
    """Train a LoRA with DeepSpeed on the cached latents and text embeddings.

    Example: diffpipe train -c config/demo.yaml --processes 2
    """
    from diffpipe.training import engine

    if processes > 1 and not engine.in_launched_rank():
        argv = ["train", "--config", str(config), "--processes", str(processes)]
        raise typer.Exit(engine.launch_local(processes, argv))
    from diffpipe.training.loop import train as run_training

    cfg, paths = _setup(config)
    run_training(cfg, paths, log=console.print)


@app.command()
@_errors
def export(
    config: ConfigOpt,
    adapter: Annotated[Path | None, typer.Option(help="Adapter folder (default: the run's final adapter).")] = None,
    out: Annotated[Path | None, typer.Option(help="Output file (default: the run's export folder).")] = None,
) -> None:
    """Export the trained LoRA as pytorch_lora_weights.safetensors (diffusers format).

    Example: diffpipe export -c config/demo.yaml
    """
    from diffpipe.export import export_diffusers
    from diffpipe.models import get_family

    cfg, paths = _setup(config)
    written = export_diffusers(adapter or paths.adapter_dir, out or paths.export_diffusers, get_family(cfg.model))
    console.print(f"export: wrote {written}")


@app.command()
@_errors
def sample(
    config: ConfigOpt,
    lora: Annotated[Path | None, typer.Option(help="LoRA file (default: the run's diffusers export).")] = None,
    out: Annotated[Path | None, typer.Option(help="Output folder (default: the run's samples folder).")] = None,
) -> None:
    """Render the config's sample prompts with the LoRA in the stock diffusers pipeline.

    Example: diffpipe sample -c config/demo.yaml
    """
    from diffpipe.training.sample import render_samples

    cfg, paths = _setup(config)
    files = render_samples(cfg.model, cfg.sample, lora or paths.export_diffusers, out or paths.samples_dir)
    console.print(f"sample: wrote {len(files)} images to {files[0].parent}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@_errors
def run(
    ctx: typer.Context,
    config: ConfigOpt,
    target: Annotated[list[str] | None, typer.Option(help="Snakemake target file or rule (repeatable).")] = None,
    profile: Annotated[Path | None, typer.Option(help="Snakemake profile folder (default: profiles/default).")] = None,
    cores: Annotated[int | None, typer.Option(help="Cores for Snakemake (default: the profile's).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="Show what would run.")] = False,
    workdir: Annotated[Path, typer.Option(help="Folder that relative config paths start from.")] = Path("."),
) -> None:
    """Run the whole workflow with Snakemake; extra arguments go to Snakemake.

    Example: diffpipe run -c config/demo.yaml --cores 2 -- --forceall
    """
    from diffpipe.runner import DEFAULT_PROFILE, run_workflow

    summary = run_workflow(config, profile=profile or DEFAULT_PROFILE, cores=cores, dry_run=dry_run,
                           targets=target or [], extra=ctx.args, workdir=workdir, console=console)
    raise typer.Exit(0 if summary.returncode == 0 else 1)


@app.command()
def schema(
    markdown: Annotated[bool, typer.Option(help="Print the README's config reference table instead.")] = False,
) -> None:
    """Print the config JSON schema (the one Snakemake validates configs with).

    Example: diffpipe schema > workflow/schemas/config.schema.json
    """
    from diffpipe.config import json_schema, reference_markdown

    text = reference_markdown() if markdown else json.dumps(json_schema(), indent=2, sort_keys=True)
    sys.stdout.write(text + "\n")


@app.command("demo-data")
def demo_data(
    out: Annotated[Path, typer.Argument(help="Folder to write the images and captions into.")],
    n: Annotated[int, typer.Option(help="Number of images.")] = 16,
    size: Annotated[int, typer.Option(help="Image side in pixels.")] = 64,
    seed: Annotated[int, typer.Option(help="Seed.")] = 0,
) -> None:
    """Write a deterministic toy dataset (coloured shapes with captions).

    Example: diffpipe demo-data /tmp/shapes --n 1000
    """
    from diffpipe.data.demo import write_demo_dataset

    write_demo_dataset(out, n=n, size=size, seed=seed)
    console.print(f"demo-data: wrote {n} images to {out}")


def main() -> None:
    app()
