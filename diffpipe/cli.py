"""The ``diffpipe`` command line: one thin command per stage, plus ``run`` and ``schema``.

Each command parses its arguments and calls one library function; errors a
user can fix print a clear message and exit 2 (usage/config) or 1 (data/run).
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from diffpipe import logs, progress, runlock, stages
from diffpipe.cli_cache import cache_app
from diffpipe.cli_common import ConfigOpt, console, errors, fail, say, setup
from diffpipe.config import ModelConfig, json_schema, reference_markdown
from diffpipe.data.dataset.demo import write_demo_dataset
from diffpipe.data.dataset.discover import vshard_names
from diffpipe.doctor import run_checks
from diffpipe.init import init_config
from diffpipe.paths import FORMATS, RunPaths
from diffpipe.resolve import folder_config, load_config
from diffpipe.runner import DEFAULT_PROFILE, run_workflow
from diffpipe.sbatch import preview
from diffpipe.stage_inputs import PlanInputs, SampleInputs, ValidateInputs

app = typer.Typer(
    help="diffpipe: fingerprinted data → sharded caches → DeepSpeed LoRA training → export → samples.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(cache_app, name="cache")


@app.callback()
def _levels(
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Show only results, warnings of ours and errors "
                                        "(libraries' warnings and Snakemake's progress hidden).")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Also show the library notices diffpipe "
                                          "filters as harmless (see diffpipe/logs.py).")] = False,
) -> None:
    """diffpipe: fingerprinted data → sharded caches → DeepSpeed LoRA training → export → samples."""
    if quiet and verbose:
        raise typer.BadParameter("give --quiet or --verbose, not both", param_hint="--quiet")
    logs.configure(quiet=quiet, verbose=verbose)
    runlock.join_run()  # a job of a `diffpipe run`: keep the run locked while this process lives


@app.command()
@errors
def validate(
    folder: Annotated[Path | None, typer.Argument(
        help="A dataset folder to check with the default rules, without a config.")] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="Experiment config (YAML).")] = None,
    out: Annotated[Path | None, typer.Option(
        help="With FOLDER: where the manifest and reports go (default: runs/validate-<folder name>).")] = None,
    rehash: Annotated[bool, typer.Option(help="Re-read every file even if size and mtime are unchanged.")] = False,
    workers: Annotated[int | None, typer.Option(help="Decoding processes (default: every core).")] = None,
    tokens: Annotated[bool, typer.Option(help="Count caption tokens with the model's tokenizers.")] = True,
) -> None:
    """Check every dataset file before any GPU time: write the manifest and the reports.

    Exits 1 when a problem whose action is `error` exists; the summary table
    is the last thing printed. Nothing in the datasets is modified. Given a
    folder instead of a config, it checks that folder with the default rules
    (caption lengths are counted with the tiny SD tokenizer, CLIP's 77-token limit).

    Example: diffpipe validate -c config/demo.yaml
    Example: diffpipe validate my_images/
    """
    from diffpipe.data.dataset.validate import kept_copy, print_summary  # deferred: pyarrow (start-up time)

    if (folder is None) == (config is None):
        raise typer.BadParameter("give a dataset FOLDER or --config, one of them", param_hint="FOLDER")
    if folder is not None:
        if not folder.is_dir():
            raise typer.BadParameter(f"{folder} is not a folder", param_hint="FOLDER")
        cfg = folder_config(folder, out)
        paths = RunPaths(cfg.output_dir)
    else:
        cfg, paths = setup(config)
    result = stages.validate(ValidateInputs.of(cfg), paths, rehash=rehash, workers=workers, tokens=tokens, console=console)
    print_summary(result, console=console, report=kept_copy(paths.report_html) if result.errors else paths.report_html)
    if result.errors:
        raise typer.Exit(1)


@app.command("validate-shard")
@errors
def validate_shard(
    config: ConfigOpt,
    shard: Annotated[str, typer.Option(help="The validation shard to probe: v0000 up to validation.shards - 1.")],
    rehash: Annotated[bool, typer.Option(help="Re-read every file even if size and mtime are unchanged.")] = False,
    workers: Annotated[int | None, typer.Option(help="Decoding processes (default: every core).")] = None,
) -> None:
    """Probe one validation shard's media files (with `validation.shards` > 1): its probe table.

    Hashes and decodes the shard's new or changed files (split by path hash) and writes
    validate/probe/<shard>.parquet; `diffpipe validate` then reuses those results and runs the
    checks over every item. The workflow runs one such job per shard.

    Example: diffpipe validate-shard -c config/demo.yaml --shard v0003
    """

    cfg, paths = setup(config)
    names = vshard_names(cfg.validation.shards)
    if shard not in names:
        which = f"{names[0]} to {names[-1]}" if names else "none: validation.shards is 1 (one validate job)"
        raise typer.BadParameter(f"no validation shard {shard!r}; the config has {which}", param_hint="--shard")
    result = stages.validate_shard(ValidateInputs.of(cfg), paths, shard, rehash=rehash, workers=workers,
                                   console=console)
    rows = (f" ({result.table_rows} table rows, {result.table_rows_probed} decoded)" if result.table_rows else "")
    say(f"validate-shard {shard}: {result.files} files, {result.probed} probed, {result.reused} unchanged{rows}; "
        f"{'wrote' if result.changed else 'kept'} {paths.validate_probe(shard)}")


@app.command()
@errors
def init(
    dataset: Annotated[Path, typer.Argument(help="Folder of images with same-stem .txt captions.")],
    model: Annotated[str, typer.Option(
        help="A local diffusers model folder (family detected from model_index.json), or tiny:<family> for "
        "the offline tiny model.")],
    family: Annotated[str | None, typer.Option(help="Model family, when it cannot be detected.")] = None,
    trigger: Annotated[str | None, typer.Option(
        help="Trigger word put before every caption and sample prompt.")] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Config file to write (never replaced).")] = Path(
        "diffpipe.yaml"),
    output_dir: Annotated[str | None, typer.Option(
        help="The run's output folder (default: runs/<dataset folder name>).")] = None,
    estimate: Annotated[bool, typer.Option(help="Add the GPU memory estimate as a comment.")] = True,
) -> None:
    """Write a commented config for a folder of images and a model, ready for `diffpipe run`.

    Family from the model, resolution and buckets from the images, sample
    prompts from their captions, LoRA defaults for the family, and the
    `diffpipe estimate` figures as a comment. An existing file is never replaced.

    Example: diffpipe init my_images/ --model models/sd15 --trigger sks
    """
    taken = f"{out} exists; diffpipe never replaces it: choose another name with --out"
    if out.exists() or out.is_symlink():
        raise typer.BadParameter(taken, param_hint="--out")
    text = init_config(dataset, model, family=family, trigger=trigger, output_dir=output_dir, estimate=estimate,
                       name_of_file=str(out))
    try:
        with open(out, "x", encoding="utf-8") as fh:  # "x": fails rather than replace a file made meanwhile
            fh.write(text)
    except FileExistsError:
        raise typer.BadParameter(taken, param_hint="--out") from None
    say(f"init: wrote {out}")
    quoted = shlex.quote(str(out))
    say(f"next: diffpipe validate -c {quoted}   (check the data), then: diffpipe run -c {quoted}")


@app.command()
@errors
def plan(config: ConfigOpt) -> None:
    """Assign manifest items to cache shards and write one spec file per shard.

    Example: diffpipe plan -c config/demo.yaml
    """
    cfg, paths = setup(config)
    result = stages.plan(PlanInputs.of(cfg), paths)
    say(f"plan: {result.items} items, {result.entries} entries in {len(result.shards)} shards; "
                  f"buckets {result.buckets}; {len(result.written)} spec files rewritten")
    for bucket, n in result.underfilled.items():
        say(f"plan: bucket {bucket} has {n} samples per epoch, fewer than a batch "
                      f"({cfg.train.batch_size * cfg.train.grad_accum}): filled by repeating its items")
    for path in result.too_short:
        say(f"plan: {path} is shorter than every frame bucket; not trained on")


@app.command()
@errors
def train(
    config: ConfigOpt,
    processes: Annotated[
        int, typer.Option(help="Local processes, one per GPU (0 or 1: one process; on CPU: gloo).")
    ] = 1,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the run's latest checkpoint.")] = False,
    checkpoint: Annotated[str | None, typer.Option(
        help="Resume from this checkpoint (a name under train/checkpoints, or a path); implies --resume.")] = None,
    auto_resume: Annotated[bool, typer.Option(
        "--auto-resume", help="Resume from the latest checkpoint if it fits this config, data and process count, "
        "else start at step 1 saying why (what the workflow's train job does).")] = False,
) -> None:
    """Train a LoRA with DeepSpeed on the cached latents and text embeddings.

    A run killed or stopped continues exactly with --resume; it refuses, naming
    the keys, when the config changed in a way the checkpoint cannot follow.
    Touch train/save in the run folder to ask for a checkpoint now.

    Example: diffpipe train -c config/demo.yaml --processes 2 --resume
    """
    # Deferred for start-up time: the trainer imports torch, which `diffpipe --help` must not load.
    from diffpipe.train_job import TrainRequest, run_train_job

    cfg, paths = setup(config)
    request = TrainRequest(config, processes, resume=resume, checkpoint=checkpoint, auto_resume=auto_resume)
    if code := run_train_job(cfg, paths, request, log=say):
        raise typer.Exit(code)


FORMATS_HELP = "diffusers, peft, comfyui, kohya, merged (repeatable or comma-separated; default: the config's)."


def _formats(values: list[str] | None) -> list[str] | None:
    """The formats given (repeated or comma-separated), checked; ``None`` when none were (the config's then)."""
    chosen = [f.strip() for v in values or [] for f in v.split(",") if f.strip()]
    bad = [f for f in chosen if f not in FORMATS]
    if bad:
        raise typer.BadParameter(f"unknown format(s) {bad}; choose from {', '.join(FORMATS)}", param_hint="--format")
    return chosen or None


@app.command()
@errors
def export(
    run_or_checkpoint: Annotated[Path | None, typer.Argument(
        help="Run folder, adapter folder (train/adapter, train/loras/epoch-N) or DeepSpeed checkpoint.")] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="Experiment config (default: the run's).")] = None,
    fmt: Annotated[list[str] | None, typer.Option("--format", "-f", help=FORMATS_HELP)] = None,
    out: Annotated[Path | None, typer.Option(help="Output folder (default: the run's export/ folder).")] = None,
) -> None:
    """Export the trained LoRA for diffusers, PEFT, ComfyUI, kohya/A1111, or merged into the base model.

    Writes every format with the same metadata, and a README.md model card.

    Example: diffpipe export runs/demo --format comfyui --format kohya
    """
    if run_or_checkpoint is None and config is None:
        raise typer.BadParameter("give a run folder, an adapter folder or checkpoint, or --config",
                                 param_hint="RUN_OR_CHECKPOINT")
    formats = _formats(fmt)
    result = stages.export(run_or_checkpoint, load_config(config) if config else None, formats=formats, out=out)
    for name, path in result.files.items():
        say(f"export: {name}: {path}")
    say(f"export: model card: {result.card}")


@app.command()
@errors
def push(
    config: ConfigOpt,
    repo: Annotated[str, typer.Option(help="Hub repository to upload to, ORG/NAME (created if absent).")],
    private: Annotated[bool, typer.Option("--private", help="Create the repository private.")] = False,
    revision: Annotated[str | None, typer.Option(help="Branch to commit to (created if absent; default: main).")] = None,
) -> None:
    """Upload the run's verified export and its model card to the Hugging Face Hub.

    The endpoint is HF_ENDPOINT (default: the Hub); the token is HF_TOKEN or `hf auth login`'s, never printed.

    Example: diffpipe push -c config/demo.yaml --repo my-org/demo-lora --private
    """
    from diffpipe.push import push_export  # deferred: huggingface_hub (start-up time)

    _, paths = setup(config)
    say(f"push: {push_export(paths.export_dir, repo, private=private, revision=revision)}")


@app.command("import-lora")
@errors
def import_lora_cmd(
    source: Annotated[Path, typer.Argument(help="LoRA file (diffusers, ComfyUI, kohya) or PEFT folder.")],
    out: Annotated[Path, typer.Argument(help="Adapter folder to write (PEFT layout, as training writes).")],
    config: Annotated[Path | None, typer.Option("--config", "-c", help="Config naming the base model.")] = None,
    family: Annotated[str | None, typer.Option(help="Model family, when no config is given (tiny flavor).")] = None,
    fmt: Annotated[str | None, typer.Option("--format", "-f", help="Force the input format (default: detect).")] = None,
) -> None:
    """Read a LoRA in any supported format back into our adapter, e.g. to continue training it.

    Example: diffpipe import-lora downloaded_lora.safetensors runs/demo/imported -c config/demo.yaml
    """
    # Deferred for start-up time: the export formats and the family registry import torch.
    from diffpipe.export import import_lora
    from diffpipe.families import get_family

    if config is None and family is None:
        raise typer.BadParameter("give --config (the base model) or --family (tiny flavor)", param_hint="--config")
    model_cfg = load_config(config).model if config else ModelConfig(family=family, flavor="tiny")
    result = import_lora(source, out, get_family(model_cfg), fmt=fmt)
    say(f"import-lora: {result}")


@app.command()
@errors
def sample(
    config: ConfigOpt,
    lora: Annotated[Path | None, typer.Option(help="LoRA file or PEFT folder (default: the run's diffusers "
                                                   "export; LoKr/LoHa: its peft export).")] = None,
    out: Annotated[Path | None, typer.Option(help="Output folder (default: the run's samples folder).")] = None,
) -> None:
    """Render the config's sample prompts with the LoRA in the stock diffusers pipeline.

    Example: diffpipe sample -c config/demo.yaml
    """
    cfg, paths = setup(config)
    files = stages.sample(SampleInputs.of(cfg), paths, lora=lora, out=out)
    say(f"sample: wrote {len(files)} images to {files[0].parent}")


@app.command()
@errors
def report(
    config: ConfigOpt,
    out: Annotated[Path | None, typer.Option(help="Where to write the page (default: <output_dir>/report.html).")] = None,
) -> None:
    """Write the run report: one self-contained HTML page (curves, samples, lineage) to open or send.

    Example: diffpipe report -c config/demo.yaml
    """
    cfg, paths = setup(config)
    result = stages.report(SampleInputs.of(cfg), paths, out=out)
    say(f"report: wrote {result.path} ({result.bytes / 1e6:.1f} MB); open it in a browser")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@errors
def run(
    ctx: typer.Context,
    config: ConfigOpt,
    target: Annotated[list[str] | None, typer.Option(help="Snakemake target file or rule (repeatable).")] = None,
    profile: Annotated[Path | None, typer.Option(help="Snakemake profile folder (default: profiles/default).")] = None,
    cores: Annotated[int | None, typer.Option(help="Cores for Snakemake (default: the profile's).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="Show what would run.")] = False,
    workdir: Annotated[Path, typer.Option(help="Folder that relative config paths start from.")] = Path("."),
    regenerate: Annotated[
        bool, typer.Option(help="Re-encode every cache shard, ignoring stored entries (and rerun what follows).")
    ] = False,
    show_sbatch: Annotated[
        bool, typer.Option(help="With a SLURM profile: print each job's sbatch command instead (submits nothing).")
    ] = False,
) -> None:
    """Run the whole workflow with Snakemake; extra arguments go to Snakemake.

    Example: diffpipe run -c config/demo.yaml --cores 2 -- --forceall
    Example: diffpipe run -c my.yaml --profile profiles/slurm --show-sbatch
    """
    if show_sbatch:
        for job in preview(config.resolve(), (profile or DEFAULT_PROFILE).resolve(), workdir.resolve(), ctx.args):
            console.print(Text.assemble((job.rule, "bold"), f" {job.wildcards}".rstrip()), highlight=False)
            say(f"  {job.command}")
            console.print(Text(f"  runs: {job.shell}", style="dim"), highlight=False, soft_wrap=True)
        return

    summary = run_workflow(config, profile=profile or DEFAULT_PROFILE, cores=cores, dry_run=dry_run,
                           targets=target or [], extra=ctx.args, workdir=workdir, console=console,
                           regenerate=regenerate)
    if summary.interrupted_by is not None:
        raise typer.Exit(128 + summary.interrupted_by)  # as a shell reports a command a signal stopped
    raise typer.Exit(0 if summary.returncode == 0 else 1)


@app.command()
@errors
def status(
    run_folder: Annotated[Path | None, typer.Argument(help="A run folder (a config's output_dir).")] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="Experiment config (YAML).")] = None,
) -> None:
    """Show each job's progress in a run (training step, loss, speed, ETA; cache shards), from any terminal.

    Reads the status files the jobs write under OUTPUT_DIR/progress: running,
    finished, failed, or stale (it said running, but its process is gone).

    Example: diffpipe status -c config/demo.yaml
    """
    if (run_folder is None) == (config is None):
        raise typer.BadParameter("give a run FOLDER or --config, one of them", param_hint="RUN_FOLDER")
    for line in progress.status_lines(run_folder if config is None else Path(load_config(config).output_dir)):
        say(line)


@app.command()
@errors
def schema(
    markdown: Annotated[bool, typer.Option(help="Print the config reference table (docs/configuration.md) instead.")] = False,
) -> None:
    """Print the config JSON schema (the one Snakemake validates configs with).

    Example: diffpipe schema > workflow/schemas/config.schema.json
    """
    text = reference_markdown() if markdown else json.dumps(json_schema(), indent=2, sort_keys=True)
    sys.stdout.write(text + "\n")


@app.command("demo-data")
@errors
def demo_data(
    out: Annotated[Path, typer.Argument(help="Folder to write the images and captions into.")],
    n: Annotated[int, typer.Option(help="Number of images.")] = 16,
    size: Annotated[int, typer.Option(help="Image side in pixels.")] = 64,
    seed: Annotated[int, typer.Option(help="Seed.")] = 0,
    clips: Annotated[int, typer.Option(help="Also write this many toy clips (a shape moving, MP4, 16 fps).")] = 0,
    frames: Annotated[int, typer.Option(help="Frames per clip.")] = 9,
) -> None:
    """Write a deterministic toy dataset (coloured shapes with captions; optionally moving-shape clips).

    Example: diffpipe demo-data /tmp/shapes --n 1000 --clips 8
    """
    write_demo_dataset(out, n=n, size=size, seed=seed)
    if clips:
        from diffpipe.data.dataset.demo_video import write_demo_clips  # deferred: imports torch (start-up time)

        write_demo_clips(out, n=clips, frames=frames, width=size, height=size * 2 // 3 // 2 * 2, seed=seed)
    say(f"demo-data: wrote {n} images{f' and {clips} clips' if clips else ''} to {out}")


@app.command()
@errors
def estimate(
    config: ConfigOpt,
    gpus: Annotated[int, typer.Option(help="Data-parallel GPUs the run would use.")] = 1,
    resolution: Annotated[int | None, typer.Option(help="Image side in pixels (default: the largest dataset resolution).")] = None,
    rank: Annotated[int | None, typer.Option(help="LoRA rank (default: train.lora.rank).")] = None,
    model: Annotated[str | None, typer.Option(help="Published model to size, e.g. flux1-dev (default: the local folder, else the family's flagship).")] = None,
    frames: Annotated[int | None, typer.Option(help="Video: pixel frames per clip (default: the largest frame bucket).")] = None,
    height: Annotated[int | None, typer.Option(help="Image height in pixels; --resolution is then the width (default: square).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the figures as JSON (bytes).")] = False,
) -> None:
    """Memory per GPU (parameters, gradients, optimizer state, activations) for a config, before any GPU is used.

    The denoiser is built at its real size on the meta device; activations are
    measured from one training forward on meta tensors.

    Example: diffpipe estimate -c config/flux.yaml --model flux1-dev --resolution 1024 --gpus 2
    """
    from diffpipe.estimate import estimate_memory  # deferred: imports torch (start-up time)

    cfg = load_config(config)
    result = estimate_memory(cfg, gpus=gpus, resolution=resolution, rank=rank, model=model, frames=frames,
                             height=height)
    sys.stdout.write((json.dumps(result.as_dict(), indent=2) if as_json else result.table()) + "\n")


@app.command("plan-memory")
@errors
def plan_memory(
    config: ConfigOpt,
    gpu_memory: Annotated[float | None, typer.Option(help="GPU memory to plan for, in GiB (default: train.gpu_memory, else this machine's GPU's free memory).")] = None,
    system_memory: Annotated[float | None, typer.Option(help="System RAM for block swap and activation offload, in GiB (default: no limit).")] = None,
    model: Annotated[str | None, typer.Option(help="Published model to size, e.g. flux1-dev (as for `diffpipe estimate`).")] = None,
    resolution: Annotated[int | None, typer.Option(help="Image side in pixels (default: the largest dataset resolution).")] = None,
    height: Annotated[int | None, typer.Option(help="Image height in pixels; --resolution is then the width (default: square).")] = None,
    frames: Annotated[int | None, typer.Option(help="Video: pixel frames per clip (default: the largest frame bucket).")] = None,
    slowdown: Annotated[float, typer.Option(min=0, help="Keep better base weights (bf16 > fp8 > int8 > nf4) while their setting is at most this much slower than the fastest that fits.")] = 0.10,
) -> None:
    """The fastest memory setting that fits a GPU, and the runner-up, each with its estimate (`train.memory: auto`).

    Searches the memory keys the config leaves unset (base_weights,
    activation_checkpointing, block_swap, activation_offload); exit 1 naming the
    closest setting when none fits.

    Example: diffpipe plan-memory -c config/flux.yaml --model flux1-dev --gpu-memory 24
    """
    from diffpipe import memory_plan as mp  # deferred: imports torch (start-up time)

    cfg = load_config(config)
    gib = gpu_memory if gpu_memory is not None else cfg.train.gpu_memory
    gpu = int(gib * mp.GiB) if gib is not None else mp.detected_gpu_bytes()
    plan = mp.plan_memory(cfg, gpu, system_bytes=int(system_memory * mp.GiB) if system_memory is not None else None,
                          slowdown=slowdown, model=model, resolution=resolution, height=height, frames=frames)
    sys.stdout.write("\n".join(plan.lines()) + "\n")


@app.command()
@errors
def bench(
    config: ConfigOpt,
    grid: Annotated[list[str] | None, typer.Option(
        "--grid", help="An axis KEY=V1,V2 (repeatable), added to or replacing the config's bench.grid; axes: "
        "batch_size, precision, base_weights, activation_checkpointing, compile, attention_backend, "
        "zero_stage, resolution, frames, or any train. key.")] = None,
    out: Annotated[Path | None, typer.Option(help="Output folder (default: OUTPUT_DIR/bench).")] = None,
    convergence: Annotated[bool, typer.Option(
        "--convergence", help="Instead: train the same data and seed at each of bench.convergence_precisions "
        "and bench.convergence_optimizers and overlay the loss curves.")] = False,
) -> None:
    """Sweep training speed and memory over a grid of settings on this machine.

    Each point trains warm-up plus measured steps of the configured model in
    its own process; an out-of-memory point is recorded as oom and the sweep
    goes on. Writes runs_summary.csv and throughput_vs_memory.png and prints the
    fastest point with the config lines that select it.

    Example: diffpipe bench -c config/demo.yaml --grid batch_size=1,2,4 --grid precision=fp32,bf16
    """
    # Deferred for start-up time: the sweep imports the trainer (torch).
    from diffpipe.bench import parse_grid_args, run_bench, run_convergence
    from diffpipe.bench.report import best_lines, convergence_lines, sweep_lines

    cfg = load_config(config)
    out_dir = out or Path(cfg.output_dir) / "bench"
    if convergence:
        if grid:
            raise typer.BadParameter("--grid sweeps speed; --convergence compares precisions and optimizers: give one",
                                     param_hint="--grid")
        result = run_convergence(cfg, out_dir, console=console)
        for line in convergence_lines(result):
            say(line)
        raise typer.Exit(0 if all(r["status"] == "ok" for r in result.rows) else 1)
    result = run_bench(cfg, out_dir, grid=parse_grid_args(grid or []), console=console)
    for line in sweep_lines(result):
        say(line)
    if result.best is None:
        fail("error", "no point trained; see the point logs under " + str(out_dir / "points"), 1)
    for line in best_lines(result):
        say(line)


@app.command()
@errors
def doctor(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="Experiment config to check against.")] = None,
    profile: Annotated[Path | None, typer.Option(help="Snakemake profile the run will use (SLURM: its tools).")] = None,
) -> None:
    """Check this machine: torch and CUDA build, GPUs against the config's memory estimate, attention
    backends, DeepSpeed ops, free disk for output and cache, SLURM tools for a SLURM profile.

    Prints one line per check, `ok` or `warn` with the fix; exits 0 (warnings do not stop a run).

    Example: diffpipe doctor -c diffpipe.yaml --profile profiles/slurm
    """
    cfg = load_config(config) if config else None
    for check in run_checks(cfg, profile=profile):
        say(check.line())


def main() -> None:
    app()
