"""Output locations shared by the Snakemake rules, the CLI and the tests.

Every path of a run lives under ``output_dir``. Templates keep Snakemake
wildcards (``{shard}``) so rules and code use the same strings.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
SNAKEFILE = REPO_ROOT / "Snakefile"
SCHEMA_FILE = REPO_ROOT / "workflow" / "schemas" / "config.schema.json"

# Relative templates (joined onto output_dir).
MANIFEST = "validate/manifest.parquet"
REPORT_JSON = "validate/report.json"
REPORT_HTML = "validate/report.html"
#: Validation shards (``validation.shards > 1``): each one's probe table and listing (its media files, with size
#: and mtime: its job's input and work list).
VALIDATE_PROBE = "validate/probe/{vshard}.parquet"
VALIDATE_LISTING = "validate/listing/{vshard}.fingerprint"
PLAN_DIR = "plan"
PLAN_SUMMARY = "plan/plan.json"
LATENT_SPEC = "plan/latents/{shard}.json"
TEXT_SPEC = "plan/text/{shard}.json"
EMPTY_SPEC = "plan/empty.json"
LATENT_SHARD = "cache/latents/{shard}.zarr"
TEXT_SHARD = "cache/text/{shard}.arrow"
TEXT_EMPTY = "cache/text/empty.arrow"
CACHE_STORE = "cache/store"
PLAN_STATE = "cache/plan-state.json"
TRAIN_DIR = "train"
ADAPTER_DIR = "train/adapter"
ADAPTER_FILE = "train/adapter/adapter_model.safetensors"
METRICS = "train/metrics.jsonl"
LOSS_PLOT = "train/loss.png"  # written by the train job beside the metrics it draws
TENSORBOARD = "train/tensorboard"
CHECKPOINTS = "train/checkpoints"
EPOCH_LORAS = "train/loras"
EXPORT_DIR = "export"
# Export formats and their names inside the export folder (``diffpipe export --out``).
FORMATS = ("diffusers", "peft", "comfyui", "kohya", "merged")
EXPORT_NAMES = {
    "diffusers": "pytorch_lora_weights.safetensors",
    "peft": "peft",  # folder: adapter_model.safetensors + adapter_config.json
    "comfyui": "comfyui_lora.safetensors",
    "kohya": "kohya_lora.safetensors",
    "merged": "merged",  # folder: a diffusers pipeline
}
EXPORT_CARD = "README.md"
#: The card `diffpipe push` uploads as the repository's README.md: only what push uploads (no merged
#: folder, no links to the run's local samples).
EXPORT_HUB_CARD = "README.hub.md"
EXPORT_DIFFUSERS = "export/pytorch_lora_weights.safetensors"
EXPORT_PEFT = "export/peft/adapter_model.safetensors"
EXPORT_COMFYUI = "export/comfyui_lora.safetensors"
EXPORT_KOHYA = "export/kohya_lora.safetensors"
EXPORT_MERGED = "export/merged/model_index.json"  # the folder is a diffusers pipeline
SAMPLES_DIR = "samples"
SAMPLE_GRID = "samples/grid.png"
LOGS = "logs"
RUN_REPORT = "report.html"  # the run report (diffpipe report): one self-contained page
BENCHMARKS = "benchmarks"
PROGRESS_DIR = "progress"  # each running job's status (diffpipe.progress): run state, never a rule's input or output
#: The rules' directory() outputs: Snakemake deletes each, with all it holds, before the job
#: that writes it (the plan's, kept by ``update()``, when its job fails: replaced by its backup),
#: so ``diffpipe run`` checks them first (diffpipe.ownership; a test reads the rules).
DIRECTORY_OUTPUTS = (PLAN_DIR, LATENT_SHARD, SAMPLES_DIR)


class _At:
    """A run's path: the template joined onto the run's ``root`` (``paths.manifest``)."""

    def __init__(self, template: str):
        self.template = template

    def __get__(self, paths: RunPaths | None, owner: type | None = None) -> Any:
        return self if paths is None else paths.root / self.template


class _AtShard(_At):
    """A shard's path: ``paths.latent_spec("s0000")``."""

    def __get__(self, paths: RunPaths | None, owner: type | None = None) -> Any:
        return self if paths is None else (lambda shard: paths.root / self.template.format(shard=shard))


@dataclass(frozen=True)
class RunPaths:
    """Concrete paths of one run, rooted at ``root`` (the config's output_dir)."""

    root: Path

    def __init__(self, root: str | Path):
        object.__setattr__(self, "root", Path(root))

    manifest = _At(MANIFEST)
    report_json = _At(REPORT_JSON)
    report_html = _At(REPORT_HTML)
    plan_dir = _At(PLAN_DIR)
    plan_summary = _At(PLAN_SUMMARY)
    latent_spec = _AtShard(LATENT_SPEC)
    text_spec = _AtShard(TEXT_SPEC)
    plan_state = _At(PLAN_STATE)
    empty_spec = _At(EMPTY_SPEC)
    latent_shard = _AtShard(LATENT_SHARD)
    text_shard = _AtShard(TEXT_SHARD)
    text_empty = _At(TEXT_EMPTY)
    train_dir = _At(TRAIN_DIR)
    adapter_dir = _At(ADAPTER_DIR)
    adapter_file = _At(ADAPTER_FILE)
    metrics = _At(METRICS)
    loss_plot = _At(LOSS_PLOT)
    tensorboard = _At(TENSORBOARD)
    checkpoints = _At(CHECKPOINTS)
    epoch_loras = _At(EPOCH_LORAS)
    export_dir = _At(EXPORT_DIR)
    export_diffusers = _At(EXPORT_DIFFUSERS)
    samples_dir = _At(SAMPLES_DIR)
    sample_grid = _At(SAMPLE_GRID)
    benchmarks = _At(BENCHMARKS)
    progress_dir = _At(PROGRESS_DIR)
    run_report = _At(RUN_REPORT)

    def cache_store(self, cache_dir: str | None = None) -> Path:
        """The content-addressed store: ``cache.dir`` when set, else under output_dir."""
        return Path(cache_dir) if cache_dir else self.root / CACHE_STORE

    def export_file(self, fmt: str, suffix: str = "") -> Path:
        """Where ``fmt`` is written (a folder for ``peft`` and ``merged``); ``suffix``: another trained part's."""
        return self.export_dir / export_name(fmt, suffix)

    def validate_probe(self, vshard: str) -> Path:
        """A validation shard's probe table (``v0000``)."""
        return self.root / VALIDATE_PROBE.format(vshard=vshard)

    def validate_listing(self, vshard: str) -> Path:
        """A validation shard's listing (its media files, size and mtime): its job's input."""
        return self.root / VALIDATE_LISTING.format(vshard=vshard)

    def shard_names(self, kind: str = "latents") -> list[str]:
        """Shard names the plan wrote (sorted), read from its spec files."""
        folder = self.plan_dir / kind
        return sorted(p.stem for p in folder.glob("*.json"))

#: Export-name suffix of Wan 2.2 A14B's low-noise expert when a run trains both experts.
LOW_NOISE_SUFFIX = "_low_noise"


def export_name(fmt: str, suffix: str = "") -> str:
    """``fmt``'s name in the export folder, with a trained part's ``suffix`` before any extension.

    ``export_name("diffusers", "_low_noise")`` is ``pytorch_lora_weights_low_noise.safetensors``
    (Wan 2.2 A14B's low-noise expert with ``model.expert: both``); ``("peft", "_low_noise")`` is ``peft_low_noise``.
    """
    name = Path(EXPORT_NAMES[fmt])
    return f"{name.stem}{suffix}{name.suffix}" if name.suffix else f"{name}{suffix}"


def shard_name(index: int) -> str:
    return f"s{index:04d}"
