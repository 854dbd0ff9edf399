"""The ``README.md`` model card written beside the exported files."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffpipe.export.metadata import ExportInfo
from diffpipe.families import Absent, spec
from diffpipe.models.spec import SampleDefaults
from diffpipe.paths import EXPORT_NAMES, RunPaths
from diffpipe.utils import write_text_atomic

HOW_TO_LOAD = {
    "diffusers": "`pipe.load_lora_weights(\"{path}\"{load_args})`",
    "peft": "`PeftModel.from_pretrained(denoiser, \"{path}\")` or `diffpipe import-lora {path}`",
    "comfyui": "copy to `ComfyUI/models/loras/`, load with *LoraLoaderModelOnly*",
    "kohya": "copy to A1111/Forge `models/Lora/`, prompt `<lora:{stem}:1>`",
    "merged": "`{pipeline}.from_pretrained(\"{path}\")` (no LoRA support needed)",
}
_KOHYA_ELSEWHERE = "copy to `ComfyUI/models/loras/` (A1111/Forge do not run this model), or kohya/musubi tooling"


def comfy_diffusers_note(family: str) -> str:
    """What ComfyUI makes of this family's diffusers file (its spec's ``comfy_reads_diffusers``), for the
    card and docs. It maps ``transformer.`` names for some families and, for SD/SDXL, ``unet.`` names
    outside the attention layers; the scale is folded into the tensors, so what it reads loads at the
    trained strength."""
    s = spec(family)
    reads = s.comfy_reads_diffusers
    if reads == "all":
        return "; ComfyUI reads it too"
    if reads == "no-model" or isinstance(s.keymap, Absent):  # no comfyui file to point to
        return ""
    part = "loads only its non-attention layers" if reads == "part" else "loads none of it"
    return f"; ComfyUI {part}: use `{EXPORT_NAMES['comfyui']}` there"


def how_to_load(fmt: str, family: str) -> str:
    """The card's "how to load" line of one format for one family (``{path}`` etc. still to fill)."""
    s = spec(family)
    if fmt in s.how_to_load:
        return s.how_to_load[fmt]
    if fmt == "diffusers":
        return HOW_TO_LOAD[fmt] + comfy_diffusers_note(family)
    if fmt == "kohya" and not s.a1111:
        return _KOHYA_ELSEWHERE
    return HOW_TO_LOAD[fmt]


_KIND_NAMES = {"lora": "LoRA", "dora": "DoRA", "lokr": "LoKr", "loha": "LoHa"}


@dataclass(frozen=True)
class CardFile:
    """One exported file (or folder) as the card lists it."""

    fmt: str
    path: Path
    #: Extra ``load_lora_weights`` arguments (e.g. ``load_into_transformer_2``) for the diffusers line.
    load_args: dict[str, object] = field(default_factory=dict)
    #: Which trained part it holds, when a run trains several ("low-noise expert"); "" otherwise.
    label: str = ""


def which_file(files: list[CardFile], family: str, folder: Path) -> list[tuple[str, list[Path]]]:
    """The card's "which file for which tool" rows: (tool, the files it should take), for the formats written."""
    by_fmt: dict[str, list[Path]] = {}
    for f in files:
        by_fmt.setdefault(f.fmt, []).append(f.path.relative_to(folder) if f.path.is_relative_to(folder) else f.path)
    s = spec(family)
    no_comfy = s.comfy_reads_diffusers == "no-model"  # ComfyUI has no model class for this family
    rows: list[tuple[str, list[Path]]] = []
    if "comfyui" in by_fmt and not no_comfy:
        rows.append(("ComfyUI", by_fmt["comfyui"]))
    elif "diffusers" in by_fmt and s.comfy_reads_diffusers == "all":
        rows.append(("ComfyUI", by_fmt["diffusers"]))
    if "diffusers" in by_fmt:
        rows.append(("diffusers", by_fmt["diffusers"]))
    if "kohya" in by_fmt:
        tools = ("`diffpipe import-lora`" if no_comfy else
                 "kohya / sd-scripts, A1111 / Forge" if s.a1111 else "kohya / sd-scripts / musubi-tuner")
        rows.append((tools, by_fmt["kohya"]))
    if "comfyui" in by_fmt and no_comfy:
        rows.append(("`diffpipe import-lora`", by_fmt["comfyui"]))
    if "peft" in by_fmt:
        rows.append(("PEFT", by_fmt["peft"]))
    if "merged" in by_fmt:
        rows.append(("any diffusers pipeline loader (LoRA fused in)", by_fmt["merged"]))
    return rows


def _trained_encoders(info: ExportInfo) -> list[str]:
    return list((((info.config or {}).get("train") or {}).get("text_encoder") or {}).get("encoders") or [])


def read_memory_plan(run: RunPaths | None) -> dict[str, Any] | None:
    """The ``train.memory: auto`` plan the run's training recorded in ``train/summary.json``; None without one."""
    summary = run.train_dir / "summary.json" if run is not None else None
    if summary is None or not summary.is_file():
        return None
    try:
        return json.loads(summary.read_text()).get("memory_plan")
    except (OSError, ValueError):  # the card is advice: a damaged summary leaves the section out
        return None


def _planned(c: dict[str, Any]) -> str:
    base = "bf16" if c["base_weights"] == "auto" else c["base_weights"]
    return (f"base_weights {base}, activation_checkpointing {'on' if c['activation_checkpointing'] else 'off'}, "
            f"block_swap {c['block_swap']}, activation_offload {'on' if c['activation_offload'] else 'off'}: "
            f"estimate {c['estimate_bytes'] / 2**30:.2f} GiB + margin {c['margin_bytes'] / 2**30:.2f} GiB, "
            f"step time x{c['step_cost']:.2f}")


def memory_plan_lines(plan: dict[str, Any]) -> list[str]:
    """The card's "Memory plan" section: what ``train.memory: auto`` chose, and the runner-up."""
    kept = f" (kept as written: {', '.join(plan['explicit'])})" if plan.get("explicit") else ""
    runner = plan.get("runner_up")
    return ["", "## Memory plan", "",
            f"Trained with `train.memory: auto` for a {plan['gpu_bytes'] / 2**30:.1f} GiB GPU{kept}:", "",
            f"- chosen: {_planned(plan['chosen'])}",
            f"- runner-up: {_planned(runner) if runner else 'none (no other setting fit)'}"]


def _base_lora_lines(info: ExportInfo, pipeline: str, included: bool = False) -> list[str]:
    """The base LoRAs the LoRA was trained over (``model.base_loras``): not in its files, to be loaded beside it;
    or, ``included`` (``export.include_base_loras``), in its files already."""
    bases = ((info.config or {}).get("model") or {}).get("base_loras") or []
    if not bases:
        return []
    table = ["| file | scale |", "| --- | --- |", *(f"| `{b['path']}` | {b['scale']:g} |" for b in bases)]
    if included:
        return ["", "## Base LoRAs", "", "Trained over these LoRAs, folded into the frozen base, and included in "
                "the files above (`export.include_base_loras`): each LoRA file holds the trained LoRA's ranks and "
                "theirs side by side, scales folded in (text encoders' parts too), and the merged folder has them "
                "in its weights. Load a file alone to reproduce training; do not load these beside it.", "", *table]
    lines = ["", "## Base LoRAs", "", "Trained over these LoRAs, folded into the frozen base; they are not in the "
             "files above. A training adapter that de-distills the base is left out on purpose (load only this "
             f"LoRA to keep the base's few-step sampling); to reproduce training, load each into `{pipeline}` "
             "first:", "", *table]
    loads = [f'pipe.load_lora_weights("{b["path"]}", adapter_name="base_{i}")' for i, b in enumerate(bases)]
    names = [f'"base_{i}"' for i in range(len(bases))]
    scales = [f"{b['scale']:g}" for b in bases]
    lines += ["", "```python", *loads, 'pipe.load_lora_weights("<this LoRA>", adapter_name="trained")',
              f'pipe.set_adapters([{", ".join(names)}, "trained"], adapter_weights=[{", ".join(scales)}, 1.0])',
              "```"]
    return lines


def sampling_lines(found: SampleDefaults, guidance_arg: str | None, info: ExportInfo) -> list[str]:
    """The card's "Sampling" section: the base model's sampling defaults (what ``diffpipe sample`` uses unless
    the config sets them), and a warning when base LoRAs may change them."""
    scale = (f", guidance scale {found.guidance_scale:g} (`{guidance_arg}`)"
             if guidance_arg and found.guidance_scale is not None else " (its guider component holds the guidance)")
    lines = ["", "## Sampling", "", f"The base model's defaults: {found.steps} steps{scale}, {found.model}'s "
             f"({found.source}). `diffpipe sample` renders with them unless the config sets `sample.steps` / "
             "`sample.guidance_scale`."]
    if ((info.config or {}).get("model") or {}).get("base_loras"):
        lines[-1] += (" This LoRA was trained over base LoRAs: a speed LoRA among them (Lightning, LightX2V) "
                      "samples with the settings its publisher gives, not these.")
    return lines


#: Formats ``diffpipe push`` leaves local (a whole pipeline): the Hub's card does not list them.
LOCAL_ONLY = frozenset({"merged"})


def write_card(out_file: str | Path, info: ExportInfo, files: list[CardFile], *, pipeline: str,
               samples: list[Path] | None = None, memory_plan: dict[str, Any] | None = None,
               sampling: tuple[SampleDefaults, str | None] | None = None, hub: bool = False,
               bases_included: bool = False) -> Path:
    """Write the model card: base model, trigger words, files and how to load them, settings, and the memory
    plan training used (``memory_plan``, under ``train.memory: auto``) and the base model's sampling defaults
    (``sampling``: its :class:`SampleDefaults` and the pipeline argument the guidance scale goes to).

    ``hub``: the card ``diffpipe push`` uploads, listing only what it uploads: no :data:`LOCAL_ONLY` format
    and no ``samples`` (they are the run's local images). ``bases_included``: the files hold the base LoRAs
    too (``export.include_base_loras``)."""
    out_file = Path(out_file)
    if hub:
        files, samples = [f for f in files if f.fmt not in LOCAL_ONLY], None
    fused = ", fused in the merged folder" if any(f.fmt == "merged" for f in files) else ""
    base = info.model_path or f"{info.family} ({info.flavor} flavor)"
    lines = [
        f"# LoRA for {base}",
        "",
        f"- family: `{info.family}`, flavor: `{info.flavor}`, base weights sha256: `{info.weights[:16]}...`",
        f"- trigger words: {', '.join(f'`{w}`' for w in info.trigger_words) or '(none)'}",
        f"- {_KIND_NAMES[info.kind]}, rank {info.rank}, alpha {info.alpha:g} (scale {info.scale:g}), "
        f"trained steps: {info.training.get('step', '?')}, epochs: {info.training.get('epoch', '?')}",
        f"- targets: {', '.join(f'`{t}`' for t in info.targets)}",
        f"- dataset: {info.dataset.get('items', '?')} items",
        *([f"- text encoders trained too (their LoRAs are in every file{fused}): "
           f"{', '.join(f'`{e}`' for e in encoders)}"] if (encoders := _trained_encoders(info)) else []),
        *([f"- weights: the exponential moving average of the trained weights (decay "
           f"{info.training['ema_decay']:g}), not the last step's"] if "ema_decay" in info.training else []),
        "",
        "## Files",
        "",
        "| format | file | how to load |",
        "| --- | --- | --- |",
    ]
    loads = []
    for f in files:
        rel = f.path.relative_to(out_file.parent) if f.path.is_relative_to(out_file.parent) else f.path
        args = "".join(f", {k}={v!r}" for k, v in f.load_args.items())  # e.g. load_into_transformer_2
        how = how_to_load(f.fmt, info.family).format(path=rel, stem=Path(rel).stem, pipeline=pipeline, load_args=args)
        lines.append(f"| {f.fmt}{f' ({f.label})' if f.label else ''} | `{rel}` | {how} |")
        if f.fmt == "diffusers" and f.label:
            loads.append(f'pipe.load_lora_weights("{rel}"{args})  # {f.label}')
    lines += _base_lora_lines(info, pipeline, bases_included)
    if len(loads) > 1:  # one LoRA per trained part: every one must be loaded
        lines += ["", f"Load every part's LoRA into `{pipeline}`:", "", "```python", *loads, "```"]
    lines += ["", "## Which file for which tool", "", "| tool | file |", "| --- | --- |"]
    lines += [f"| {tool} | {', '.join(f'`{p}`' for p in paths)} |"
              for tool, paths in which_file(files, info.family, out_file.parent)]
    if sampling:
        lines += sampling_lines(*sampling, info)
    if memory_plan:
        lines += memory_plan_lines(memory_plan)
    if samples:
        lines += ["", "## Samples", "", "Rendered by `diffpipe sample` (top row: base model, bottom row: this LoRA).", ""]
        lines += [f"![sample]({p})" for p in samples]
    write_text_atomic(out_file, "\n".join(lines) + "\n")
    return out_file
