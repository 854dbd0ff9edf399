"""The docs' family tables, generated from the family specs (``python -m diffpipe.readme_tables``).

``docs/families.md`` (what each family trains and where its published sizes come from),
``docs/formats.md`` (which tools read each family's ComfyUI and kohya files) and
``docs/training.md`` (which families train pipeline parallel, and each family's sampling defaults) hold these
between markers;
``tests/unit/test_docs.py`` checks them against the code.
"""

from __future__ import annotations

from diffpipe.families import NOT_IMPLEMENTED, Absent, specs
from diffpipe.paths import EXPORT_NAMES


def _formats(s) -> str:
    """The export formats a family writes: all five, or the ones its missing spec parts leave."""
    have = ["diffusers", "peft", "merged"]
    if not isinstance(s.keymap, Absent):
        have[2:2] = ["comfyui", "kohya"]
    return "all five" if len(have) == 5 else ", ".join(have)


def _sizes(s) -> str:
    def figure(p) -> str:  # the published figure, to the digits it was published with
        scale, unit = (1e9, "B") if p.params >= 1e9 else (1e6, "M")
        return f"{p.params / scale:.{p.params_digits}g}{unit}"

    return ", ".join(f"{figure(p)} (`{p.name}`)" for p in s.published)


def families_markdown() -> str:
    rows = ["| family | model | tasks | default LoRA targets | export formats | published denoiser sizes |",
            "| --- | --- | --- | --- | --- | --- |"]
    for s in specs():
        rows.append(f"| `{s.name}` | {s.model} | {s.tasks} | {s.targets} | {_formats(s)} | {_sizes(s)} |")
    return "\n".join(rows)


def formats_markdown() -> str:
    rows = [f"| family | comfyui (`{EXPORT_NAMES['comfyui']}`, keys `diffusion_model.<original>`) | kohya "
            f"(`{EXPORT_NAMES['kohya']}`, `lora_unet_<original>` + `ss_*`/`modelspec.*` metadata) |",
            "| --- | --- | --- |"]
    for s in specs():
        if isinstance(s.keymap, Absent):
            rows.append(f"| `{s.name}` | none: {s.keymap.reason} | none |")
        else:
            rows.append(f"| `{s.name}` | {s.comfyui_readers} | {s.kohya_readers} |")
    return "\n".join(rows)


def pipeline_markdown() -> str:
    rows = ["| family | pipeline-parallel layers |", "| --- | --- |"]
    for s in specs():
        if isinstance(s.layers, Absent):
            what = f"refused: {s.layers.reason}"
        else:
            module = s.layers or f"{s.package}.layers"
            what = f"`{module.replace('.', '/')}.py`" + (f" (refused: {s.layers_refused})" if s.layers_refused else "")
        rows.append(f"| `{s.name}` | {what} |")
    return "\n".join(rows)


def not_implemented_markdown() -> str:
    rows = ["| model | diffusers LoRA loader | why it is not a family |", "| --- | --- | --- |"]
    for name, (mixin, why) in NOT_IMPLEMENTED.items():
        rows.append(f"| {name} | {f'`{mixin}`' if mixin else '-'} | {why} |")
    return "\n".join(rows)


def sampling_markdown() -> str:
    """Each family's sampling defaults (its spec's ``sampling`` table): what null ``sample.steps`` /
    ``sample.guidance_scale`` resolve to, the pipeline argument the scale goes to, and where they come from."""
    rows = ["| family | for | steps | guidance scale | argument | from |", "| --- | --- | --- | --- | --- | --- |"]
    for s in specs():
        arg = s.family_type().guidance_arg
        for key, d in s.sampling.items():
            which = f"`{s.name}`" + (f" ({key})" if key is not None else "")
            scale = "-" if d.guidance_scale is None else f"{d.guidance_scale:g}"
            rows.append(f"| {which} | {d.model or s.model} | {d.steps} | {scale} | "
                        f"{f'`{arg}`' if arg else 'none (guider component)'} | {d.source} |")
    return "\n".join(rows)
